"""The memory each worker of a job is predicted to hold at its peak, from a profile.

Per worker, :func:`pipetrain.costs.worker_memory_bytes` of each stage it holds: the stage's weights, the
weight versions its schedule stashes and the activations of the (micro)batches it holds in flight
(:meth:`~pipetrain.schedule.kinds.PipelineSchedule.weight_versions`,
:meth:`~pipetrain.schedule.kinds.PipelineSchedule.in_flight`, :func:`pipetrain.costs.stage_memory_bytes`),
its gradients, its optimizer's state, the gradient copies its synchronizer holds
(:meth:`~pipetrain.strategies.kinds.Strategy.sync_bytes`), and once per worker the process baseline the
profile carries (:attr:`pipetrain.profiling.Profile.baseline_bytes`). The partitioner's memory limit
counts the same (:func:`pipetrain.planning.plan`'s ``memory``).

What a worker holds is what :attr:`pipetrain.TrainResult.peak_memory` measures on the CPU (the
process's peak resident memory) and ``peak_device_memory`` on a GPU (``torch.cuda.max_memory_allocated``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipetrain import costs
from pipetrain.profiling import Profile
from pipetrain.stagecost import StageCost, stage_costs

if TYPE_CHECKING:
    from pipetrain.config import JobConfig


def held_bytes(stage: StageCost, microbatches: int, in_flight: int, versions: int, recompute: bool,
               sync_bytes: int = 0) -> float:
    """What one worker of ``stage`` (its costs at the minibatch a worker runs) holds, its baseline left
    out: :func:`pipetrain.costs.worker_memory_bytes` with ``in_flight`` (micro)batches of the minibatch's
    ``microbatches`` and ``versions`` stashed weight versions."""
    kept = costs.stage_memory_bytes(stage.parameter_bytes, stage.stash_bytes / microbatches, in_flight,
                                    stage.input_bytes / microbatches, recompute, versions)
    return float(costs.worker_memory_bytes(kept, stage.gradient_bytes, stage.optimizer_bytes, sync_bytes))


def predict_memory(profile: Profile, cfg: JobConfig) -> list[int]:
    """Each worker's predicted peak bytes in the job ``cfg`` describes (see the module docstring), from
    ``profile`` (of its model, at any batch size: activations scale with the rows a worker runs).

    A pipeline stage's worker holds ``schedule.in_flight(replicas, workers to the output)``
    microbatches; a worker of a looped schedule holds each of its stages as a worker of a straight
    pipeline of all the stages would (as ``schedule="auto"`` prices it); a data-parallel worker holds
    the whole model and one shard of the minibatch in flight, no stashed version."""
    t, layout, schedule = cfg.training, cfg.layout, cfg.schedule
    boundaries = list(layout.boundaries) if layout.boundaries is not None else [0]
    rows = t.batch_size // cfg.world if cfg.data_parallel else t.batch_size
    stages = stage_costs(profile, boundaries, rows)
    device = "cuda" if profile.device.startswith("cuda") else "cpu"
    n = layout.num_stages
    out = []
    for rank in range(cfg.world):
        total = float(profile.baseline_bytes)
        for s, _, _ in cfg.stages_of(rank, len(profile)):
            replicas = 1 if cfg.looped else layout.replicas[s]
            to_output = n - s if cfg.looped else sum(layout.replicas[s:])
            flight = 1 if schedule is None else schedule.in_flight(replicas, to_output)
            versions = 0 if schedule is None else schedule.weight_versions(replicas, to_output)
            sync = cfg.strategy.sync_bytes(stages[s].gradient_bytes, layout.replicas[s], device)
            total += held_bytes(stages[s], cfg.microbatches, flight, versions, t.recompute, sync)
        out.append(int(total))
    return out
