"""The memory each worker of a job will hold at its peak, predicted before any worker starts from the
model's shapes alone: nothing is computed, nothing is materialized, so a model that fits nowhere whole
is predicted in seconds.

Each stage (data parallelism: the whole model, on a worker's shard) runs one microbatch's forward on
the meta device, the loss too at the output stage, with ``torch.autograd.graph.saved_tensors_hooks``
counting the storages autograd saves for the backward, the stage's weights left out: what the runtime
counts as a microbatch's stash (:mod:`pipetrain.runtime.footprint`), measured on shapes. Then per worker
(:func:`pipetrain.costs.worker_memory_bytes` of :func:`pipetrain.costs.stage_memory_bytes`):

* the weights, and the versions the schedule stashes beside them
  (:meth:`~pipetrain.schedule.kinds.PipelineSchedule.weight_versions`);
* the stash of each (micro)batch in flight (:meth:`~pipetrain.schedule.kinds.PipelineSchedule.in_flight`),
  and one more: while a backward runs, the gradients of a microbatch's activations take about its
  stash again (ours);
* the gradients of the trainable weights, the optimizer's state (its bytes per trainable byte, read
  off one step of the job's optimizer on a small tensor), the gradient copies the synchronizer holds
  (:meth:`~pipetrain.strategies.kinds.Strategy.sync_bytes`);
* on the CPU, the process baseline (:func:`pipetrain.runtime.resident.baseline`); a GPU's allocator
  counts tensors only.

What it leaves out: a single operation's temporaries, messages in transit, and memory the allocator
keeps after freeing it (a CPU worker's malloc holds on to freed blocks:
:func:`pipetrain.runtime.launch.keep_freed_memory`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipetrain import costs
from pipetrain.batches import call, collate_parts, map_tensors, tensor_bytes
from pipetrain.streams import head
from pipetrain.errors import one_line, warn
from pipetrain.layers import flatten, received, unflatten
from pipetrain.runtime.parts import meta_copy, modules_of
from pipetrain.stagecode import set_device

if TYPE_CHECKING:
    from pipetrain.config import JobConfig
    from pipetrain.layers import LayeredModel

META = torch.device("meta")


@dataclass(frozen=True)
class StageBytes:
    """What one microbatch costs a stage in memory, read off its shapes.

    Attributes:
        weights: its parameters' bytes.
        trainable: its trainable parameters' bytes (their gradients take as much).
        stash: what one microbatch keeps from its forward to its backward: the storages autograd saves
            (its weights left out) and the input it received, each once.
        inputs: the input it received (what a microbatch keeps with ``recompute``).
    """

    weights: int
    trainable: int
    stash: int
    inputs: int


def predict_memory(cfg: JobConfig, layers: LayeredModel | None, baseline: int = 0) -> list[int]:
    """Each rank's predicted peak bytes in the job ``cfg`` describes (see the module docstring), its
    stages cut from ``layers`` (None: data parallelism, the whole model), plus ``baseline`` per worker.
    [] with a warning where the model does not run on the meta device (data-dependent shapes)."""
    try:
        stages = stage_bytes(cfg, layers)
    except Exception as e:  # the user's model on meta tensors; the prediction is a report, training goes on
        warn(f"pipetrain could not run the model on the meta device to predict its workers' memory ({one_line(e)}); "
             "training without the prediction")
        return []
    return worker_bytes(cfg, stages, optimizer_ratio(cfg.training.optimizer), baseline,
                        "cuda" if torch.cuda.is_available() else "cpu")


def worker_bytes(cfg: JobConfig, stages: dict[int, StageBytes], optimizer: float, baseline: int,
                 device: str = "cpu") -> list[int]:
    """Each rank's peak bytes from its stages' :class:`StageBytes`, ``optimizer`` bytes of optimizer state
    per trainable byte and ``baseline`` per worker, the gradient copies priced for ``device``."""
    layout, schedule = cfg.layout, cfg.schedule
    n = layout.num_stages
    out = []
    for rank in range(cfg.world):
        total = float(baseline)
        for s in cfg.stage_indices(rank):
            stage = stages[s]
            replicas = 1 if cfg.looped else layout.replicas[s]
            to_output = n - s if cfg.looped else sum(layout.replicas[s:])
            flight = 1 if schedule is None else schedule.in_flight(replicas, to_output)
            versions = 0 if schedule is None else schedule.weight_versions(replicas, to_output)
            kept = costs.stage_memory_bytes(stage.weights, stage.stash, flight, stage.inputs, cfg.training.recompute,
                                            versions)
            sync = cfg.strategy.sync_bytes(stage.trainable, layout.replicas[s], device)
            # + stash: a running backward's gradients of one microbatch's activations take about as much
            total += costs.worker_memory_bytes(kept + stage.stash, stage.trainable, stage.trainable * optimizer, sync)
        out.append(int(total))
    return out


def stage_bytes(cfg: JobConfig, layers: LayeredModel | None) -> dict[int, StageBytes]:
    """Per stage, its :class:`StageBytes` from one forward on the meta device of the first microbatch (a
    data-parallel worker's shard), as the runtime runs it: what a stage receives is taken through
    :func:`pipetrain.layers.received` (a leaf and the copy the stage runs on), the loss at the output
    stage."""
    t = cfg.training
    rows = t.batch_size // (cfg.world if cfg.data_parallel else cfg.microbatches)
    x, target = (map_tensors(v, lambda a: a.to(META)) for v in
                 collate_parts(head(t.dataset, rows), range(rows), (0, 1), t.target_key, t.collate_fn))
    ranges = [(s, *cfg.layout.layer_range(s, len(layers))) for s in range(cfg.layout.num_stages)] if layers else []
    stages = modules_of(layers, t.model, ranges)
    out = {}
    for s, module in stages:
        module = meta_copy(module)
        set_device(module, META)
        leaves: list[torch.Tensor] = []
        if s > 0:
            tensors, is_tuple = flatten(x)
            leaves, fed = received(tensors, True)
            x = unflatten(fed, is_tuple)
        with saved_storages(module, leaves) as saved:
            x = call(module, x)
            if s == len(stages) - 1:
                t.loss_fn(x, target)
        weights = list(module.parameters())
        out[s] = StageBytes(tensor_bytes(weights), tensor_bytes(p for p in weights if p.requires_grad),
                            sum(saved.values()), tensor_bytes(leaves))
    return out


class saved_storages:
    """Inside it, the dict it gives holds the bytes of each storage autograd saves, each once,
    ``module``'s weights left out, ``also`` (a stage's received inputs) counted whether saved or not:
    :func:`pipetrain.runtime.footprint.saved`'s count, on the meta device, where a tensor has no address,
    by its storage's identity."""

    def __init__(self, module: nn.Module, also: list[torch.Tensor]) -> None:
        self.weights = {p.untyped_storage()._cdata for p in module.parameters()}
        self.found: dict[int, int] = {}
        for t in also:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage._cdata not in self.weights:
            self.found[storage._cdata] = storage.nbytes()

    def __enter__(self) -> dict[int, int]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(t)
            return t
        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self.found

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)


def optimizer_ratio(optimizer: Callable[..., torch.optim.Optimizer]) -> float:
    """Bytes of the optimizer's state per byte of trainable weights: its tensors after two steps on a
    small parameter (SGD 0, SGD with momentum 1, Adam 2), scalar counters left out."""
    p = nn.Parameter(torch.zeros(256))
    opt = optimizer([p])
    for _ in range(2):
        p.grad = torch.ones_like(p)
        opt.step()
    held = [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim()]
    return tensor_bytes(held) / tensor_bytes([p])
