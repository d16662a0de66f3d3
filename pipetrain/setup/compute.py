"""The set-up's compute probes: how much slower the workers compute all at once than one alone, how
much their calls vary, and the memory rates of a copy and an add."""
from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from pipetrain.batches import call, tensors_of
from pipetrain.layers import LayeredModel, flatten, received, unflatten
from pipetrain.runtime.parts import Source, layer_stage
from pipetrain.timing import median_seconds


SETTLE_EXCESS = 1.5
"""How far a set-up's compute slowdown may exceed what the cores explain (:func:`sample_compute`)
before the rounds are taken again: a virtual machine may run its cores as fewer for a spell of
seconds, and a slowdown read in one is the spell's, not the job's."""

SETTLE_SECONDS = 12.0
"""The longest :func:`sample_compute` goes on taking rounds for a reading the cores explain: longer
than such a spell lasts."""


@dataclass(frozen=True)
class ModelStep:
    """A kernel for :func:`pipetrain.setup.measure_setup`: one forward and backward of ``model`` on
    ``batch`` (an ``(input, target)`` pair), the work the workers of a job share the cores with."""

    model: torch.nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]

    @property
    def rows(self) -> int:
        """Samples in the batch: the first dimension of its first input tensor."""
        first = next((t for t in pytree.tree_leaves(self.batch[0]) if isinstance(t, torch.Tensor)), None)
        return int(first.shape[0]) if first is not None and first.dim() else 1

    def __call__(self) -> None:
        x, y = self.batch
        self.loss_fn(call(self.model, x), y).backward()
        self.model.zero_grad(set_to_none=True)


def model_step(model: torch.nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> ModelStep:
    """A :class:`ModelStep` kernel of ``model`` on ``batch`` with ``loss_fn``."""
    return ModelStep(model, batch, loss_fn)


@dataclass
class LayerStep:
    """A kernel for :func:`pipetrain.setup.measure_setup` that stands in for a model whose training step
    is too long to run the dozens of times the probes call it: one forward and backward (seeded with
    ones) of one of its layers, ``stage``, on what that layer receives, ``inputs``. Only the layer
    travels to the probes' processes, not the model."""

    stage: torch.nn.Module
    inputs: Any

    def __call__(self) -> None:
        tensors, is_tuple = flatten(self.inputs)
        out = self.stage(unflatten(received(tensors, True)[1], is_tuple))
        roots = [t for t in flatten(out)[0] if t.requires_grad]
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        self.stage.zero_grad(set_to_none=True)


def layer_step(model: torch.nn.Module, example: Any, layer_s: list[float], seconds: float,
               source: Source | None = None) -> LayerStep | None:
    """The :class:`LayerStep` of ``model`` (cut as :class:`pipetrain.layers.LayeredModel` cuts it on the
    minibatch input ``example``) at its first layer, after the first and before the last, whose forward
    and backward (``layer_s``, per layer, at the minibatch) take at least the median layer's: a typical
    layer, reached with little compute. It runs on as many of the minibatch's rows as take about
    ``seconds`` (at least one), or on all of them where the layer does not take fewer. None for a model
    of under 3 layers.

    The layers run on ``example``'s device one at a time, each built as the profiler builds it
    (:func:`pipetrain.runtime.parts.layer_stage`, its tensors from ``source``: default, the model's
    own, initialized where they are on the meta device), so a model built there is never whole."""
    if len(layer_s) < 3:
        return None
    middle = layer_s[1:-1]
    k = 1 + next(i for i, s in enumerate(middle) if s >= statistics.median(middle))
    layers = LayeredModel(model, example)
    source = source or Source.of(model, None, 0)
    device = tensors_of(example)[0].device
    x = example
    with torch.no_grad():
        for j in range(k):
            x = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, call(layer_stage(layers, j, j, source, device), x))
    stage = layer_stage(layers, k, k, source, device)
    n = flatten(x)[0][0].shape[0] if flatten(x)[0][0].dim() else 1
    rows = max(1, min(n, int(n * seconds / max(layer_s[k], 1e-12))))
    fewer = LayerStep(stage, pytree.tree_map_only(torch.Tensor, lambda t: t[:rows] if t.dim() and len(t) == n else t, x))
    try:
        fewer()
        return fewer
    except Exception:  # the cut carries a tensor whose first dimension is not the rows'
        return LayerStep(stage, x)


def matmul(n: int) -> None:
    """The default kernel: a float32 matmul of two ``n`` x ``n`` matrices."""
    a = torch.randn(n, n)
    (a @ a).sum().item()


def run_for(kernel: Callable[[], Any], seconds: float, stop: threading.Event | None = None) -> list[float]:
    """Seconds of each call of ``kernel`` (after one untimed) over ``seconds``, or until ``stop`` is set
    if given; at least one call."""
    kernel()
    calls: list[float] = []
    t0 = time.perf_counter()
    while not calls or not (stop.is_set() if stop is not None else time.perf_counter() - t0 >= seconds):
        start = time.perf_counter()
        kernel()
        calls.append(time.perf_counter() - start)
    return calls


def jitter_of_calls(calls: list[list[float]]) -> float:
    """:attr:`~pipetrain.setup.data.Setup.jitter_s` from every worker's call times in one round: the variance of all the calls
    about their common mean (a worker slower throughout counts, as it holds back the others at every
    sync), over that mean (the variance of work of d seconds grows as d when it is interrupted at random
    moments, as time slices are)."""
    pooled = [t for ts in calls for t in ts]
    return statistics.pvariance(pooled) / statistics.mean(pooled) if len(pooled) > 1 else 0.0


def sample_compute(workers: int, threads: int, kernel: Callable[[], Any], seconds: float, window: int,
                   settle_s: float, rank: int, device: torch.device) -> tuple[list[float], list[float], list[float]]:
    """The compute rounds of the set-up's probe (a collective: every rank calls it): rank 0 runs ``kernel``
    alone for ``seconds``, then ranks below ``workers`` run it at once, ``window`` times. Rank 0's
    ratio of the two (rank 0's rounds only: other ranks hold 1.0), and the jitter and the step of each
    round.

    Where the median ratio of the last ``window`` rounds is more than :data:`SETTLE_EXCESS` times
    what the cores explain (one, or the workers' threads over the cores where they outnumber them), the
    machine was taking cores from the job while it was sampled, which comes in spells of seconds:
    rounds go on, one at a time, until the last ``window`` read within it (those are kept) or
    ``settle_s`` has passed (every round is kept: the load is the machine's, and the job will meet it)."""
    explained = max(1.0, workers * threads / (os.cpu_count() or 1))
    ratios: list[float] = []
    jitters: list[float] = []
    steps: list[float] = []
    settling = 0.0
    while True:
        dist.barrier()
        alone = statistics.mean(run_for(kernel, seconds)) if rank == 0 else 0.0
        dist.barrier()
        together = run_for(kernel, seconds) if rank < workers else []
        times: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(times, together)
        ratios.append(statistics.mean(statistics.mean(t) for t in times[:workers]) / alone if rank == 0 else 1.0)
        jitters.append(jitter_of_calls(times[:workers]))
        steps.append(statistics.mean(t for ts in times[:workers] for t in ts))
        if len(ratios) < window:
            continue
        if len(ratios) == window:
            settling = time.perf_counter()
        # rank 0 alone knows the ratios: 1 the last rounds are explained, 2 the time is up, 0 go on
        explained_now = workers < 2 or statistics.median(ratios[-window:]) <= SETTLE_EXCESS * explained
        verdict = torch.tensor([1 if explained_now else 2 if time.perf_counter() - settling >= settle_s else 0],
                               device=device)
        dist.broadcast(verdict, 0)
        if verdict.item():
            kept = window if verdict.item() == 1 else len(ratios)
            return ratios[-kept:], jitters[-kept:], steps[-kept:]


def memory_s_per_byte(device: torch.device, op: Callable[[torch.Tensor, torch.Tensor], Any],
                      nbytes: int = 1 << 24) -> float:
    """Seconds per byte of ``op(b, a)`` (``Tensor.copy_``, ``Tensor.add_``) on ``nbytes`` on ``device``
    (median of 5)."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.ones_like(a)
    return median_seconds(lambda: op(b, a), 5, sync=torch.cuda.synchronize if device.type == "cuda" else None) \
        / nbytes
