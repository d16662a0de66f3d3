"""The one place that names schedules and strategies, and builds a schedule from a name.

A *strategy* says how the workers share the training: ``pipeline`` cuts the model into stages
(PipeDream) and runs a *schedule*; the data-parallel strategies give every worker the whole model and a
shard of every minibatch, and differ in how gradients are agreed on. Everything that depends on a
name (which options apply, the weight policy at run time, which sync pass and synchronizer) is read
from these tables; no other module tests a name.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.schedule import generators as gen
from pipetrain.schedule.actions import Schedule
from pipetrain.strategies.allreduce import replica_groups
from pipetrain.strategies.base import GradSync, SyncContext
from pipetrain.strategies.cgdp import cgdp
from pipetrain.strategies.ddp import ddp
from pipetrain.strategies.pipesgd import pipe_sgd

Order = Callable[[Sequence[int], int, int], gen.Lists]


@dataclass(frozen=True)
class ScheduleSpec:
    """A pipeline schedule.

    Attributes:
        name: what ``schedule=`` says.
        order: the compute order, ``order(replicas, minibatches, microbatches)``.
        flush: one update per minibatch after its last microbatch, no minibatch in flight across an
            update (live weights); else an update after every backward (1F1B with weight versions).
        microbatched: accepts ``microbatches > 1``.
        replicable: stages may be replicated (round robin over replicas).
        weights: the run-time weight policy (:data:`pipetrain.runtime.weights.POLICIES`).
        summary: one line for help texts.
    """

    name: str
    order: Order
    flush: bool
    microbatched: bool
    replicable: bool
    weights: str
    summary: str


SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("pipedream", gen.pipedream_order, flush=False, microbatched=False, replicable=True,
                 weights="stash", summary="1F1B with NOAM in flight and weight stashing (PipeDream)"),
    ScheduleSpec("naive", gen.pipedream_order, flush=False, microbatched=False, replicable=True,
                 weights="naive", summary="pipedream's order without stashing (the paper's ablation)"),
    ScheduleSpec("gpipe", gen.gpipe_order, flush=True, microbatched=True, replicable=False,
                 weights="live", summary="all microbatch forwards, then backwards, then one update"),
    ScheduleSpec("1f1b-flush", gen.one_f_one_b_flush_order, flush=True, microbatched=True, replicable=False,
                 weights="live", summary="1F1B over a minibatch's microbatches, then one update"),
    ScheduleSpec("model-parallel", gen.model_parallel_order, flush=True, microbatched=False, replicable=False,
                 weights="live", summary="one minibatch in the pipeline at a time"),
)}


DEFAULT_SCHEDULE = "pipedream"


@dataclass(frozen=True)
class StrategySpec:
    """A way to share training among workers.

    Attributes:
        name: what ``strategy=`` says.
        data_parallel: every worker holds the whole model and takes a shard of every minibatch.
        options: the ``train`` options only this strategy takes (each must be left at its default
            by the others).
        compresses: takes ``compression=`` (a codec inside its own ring allreduce).
        stale: takes ``staleness=`` (K) and ``warmup_epochs=``; else it is synchronous (K = 1).
        synchronizer: builds a worker's gradient synchronizer (collectively: every rank calls it),
            or None where the worker needs none.
        summary: one line for help texts.
    """

    name: str
    data_parallel: bool
    options: tuple[str, ...]
    compresses: bool
    stale: bool
    synchronizer: Callable[[SyncContext], GradSync | None]
    summary: str


PIPELINE_OPTIONS = ("stages", "schedule", "vertical_sync", "microbatches")
STRATEGIES: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec("pipeline", data_parallel=False, options=PIPELINE_OPTIONS, compresses=False, stale=False,
                 synchronizer=replica_groups, summary="stages on workers, run by a schedule (PipeDream and others)"),
    StrategySpec("ddp", data_parallel=True, options=(), compresses=False, stale=False, synchronizer=ddp,
                 summary="PyTorch DistributedDataParallel: synchronous, allreduce inside the backward"),
    StrategySpec("pipe-sgd", data_parallel=True, options=("staleness", "compression", "warmup_epochs"),
                 compresses=True, stale=True, synchronizer=pipe_sgd,
                 summary="Pipe-SGD: the allreduce of minibatch t overlaps the compute of t+1..t+K-1"),
    StrategySpec("cgdp", data_parallel=True, options=("chunk",), compresses=False, stale=False, synchronizer=cgdp,
                 summary="CPU-GPU data parallel: chunks of layers summed in shared host memory during the "
                         "backward (one machine, or hierarchical)"),
)}


def lookup(table: dict[str, Any], name: str, what: str) -> Any:
    """``table[name]``, or a one-line ValueError listing the choices."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(table)}")
    return table[name]


def build_schedule(name: str, replicas: Sequence[int], minibatches: int, microbatches: int = 1) -> Schedule:
    """Build the named pipeline schedule: compute order, then the p2p pass, then its sync pass.

    Args:
        name: a key of :data:`SCHEDULES`.
        replicas: workers per stage (all 1 for a straight pipeline).
        minibatches: minibatches to train.
        microbatches: microbatches per minibatch (microbatched schedules only).

    Raises:
        ValueError: unknown name, bad counts, or a schedule asked for what it cannot do.
    """
    spec: ScheduleSpec = lookup(SCHEDULES, name, "schedule")
    if not replicas or any(r < 1 for r in replicas):
        raise ValueError(f"replicas per stage must be positive integers, got {list(replicas)}")
    if minibatches < 0 or microbatches < 1:
        raise ValueError(f"need minibatches >= 0 and microbatches >= 1, got {minibatches}, {microbatches}")
    if not spec.replicable and any(r != 1 for r in replicas):
        raise ValueError(f"schedule {name!r} runs straight pipelines only (one worker per stage); "
                         f"use 'pipedream' for replicated stages {list(replicas)}")
    lcm = math.lcm(*replicas)
    if minibatches % lcm:
        raise ValueError(f"{minibatches} minibatches do not split evenly over replicas {list(replicas)}; "
                         f"use a multiple of {lcm} so every replica joins every gradient sync")
    if not spec.microbatched and microbatches != 1:
        microbatched = ", ".join(repr(s.name) for s in SCHEDULES.values() if s.microbatched)
        raise ValueError(f"schedule {name!r} does not split minibatches; use microbatches=1 or {microbatched}")
    lists = gen.p2p_pass(replicas, spec.order(replicas, minibatches, microbatches))
    lists = gen.flush_sync(lists, microbatches) if spec.flush else gen.step_sync(lists, replicas)
    return Schedule(name, tuple(replicas), tuple(map(tuple, lists)), microbatches, gen.noam(replicas),
                    stashes=spec.weights == "stash")


def build_data_parallel(name: str, workers: int, minibatches: int, staleness: int = 1) -> Schedule:
    """The schedule of a data-parallel strategy: every worker runs every minibatch's shard, then the
    strategy's sync pass (Pipe-SGD's with ``staleness`` K; K = 1 is synchronous SGD).

    Raises:
        ValueError: unknown strategy, a pipeline, workers < 1, or staleness < 1.
    """
    spec: StrategySpec = lookup(STRATEGIES, name, "strategy")
    if not spec.data_parallel:
        raise ValueError(f"strategy {name!r} is not data parallel; use build_schedule for pipelines")
    return gen.data_parallel(workers, minibatches, staleness, name)
