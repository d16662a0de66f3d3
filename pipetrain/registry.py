"""The strategies and pipeline schedules pipetrain runs, each a small class that owns its options.

A *strategy* says how the workers share the training: :class:`Pipeline` cuts the model into stages
(PipeDream) and runs a *schedule*; :class:`DDP`, :class:`PipeSGD` and :class:`CGDP` give every worker
the whole model and a shard of every minibatch, and differ in how gradients are agreed on. Each class
carries what depends on it: its options (checked when made, so an option of one strategy cannot be
given to another), the facts the runtime, validator and simulator read (flush, weight policy,
replication), and its hooks (the schedule it runs, the synchronizer a worker builds, its prediction).
No other module tests a strategy's or a schedule's name.

``"gpipe"`` and ``GPipe()`` mean the same; ``GPipe(microbatches=4)`` sets an option.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from pipetrain.layout import Layout
from pipetrain.schedule import generators as gen
from pipetrain.schedule.actions import Schedule
from pipetrain.strategies.allreduce import replica_groups
from pipetrain.strategies.base import GradSync, SyncContext
from pipetrain.strategies.cgdp import HOST_MEMORY, cgdp, host_bytes
from pipetrain.strategies.compression import get_codec
from pipetrain.strategies.ddp import ddp
from pipetrain.strategies.pipesgd import pipe_sgd


def _count(value: Any, what: str, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what}={value!r} must be an integer >= {least}")


# -- pipeline schedules -----------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule: the order of each worker's forwards and backwards, and when it updates.

    Class attributes (facts, not options):
        name: what ``schedule=`` says.
        flush: one update per minibatch after its last microbatch, no minibatch in flight across an
            update (live weights); else an update after every backward (1F1B with weight versions).
        replicable: stages may be replicated (round robin over replicas).
        weights: the run-time weight policy (:data:`pipetrain.runtime.weights.POLICIES`).
        summary: one line for help texts.
    """

    name: ClassVar[str]
    flush: ClassVar[bool]
    replicable: ClassVar[bool] = False
    weights: ClassVar[str] = "live"
    summary: ClassVar[str]

    @property
    def microbatches(self) -> int:
        """Microbatches per minibatch (1: minibatches are not split)."""
        return 1

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        """Each worker's compute order (forwards and backwards only)."""
        raise NotImplementedError

    def build(self, replicas: Sequence[int], minibatches: int) -> Schedule:
        """The action lists: compute order, then the point-to-point pass, then the sync pass.

        Raises:
            ValueError: bad counts, or stages this schedule cannot run.
        """
        layout = Layout(tuple(replicas))
        self.check_layout(layout)
        if minibatches < 0:
            raise ValueError(f"need minibatches >= 0, got {minibatches}")
        if minibatches % layout.rounds:
            raise ValueError(f"{minibatches} minibatches do not split evenly over replicas {list(replicas)}; "
                             f"use a multiple of {layout.rounds} so every replica joins every gradient sync")
        lists = gen.p2p_pass(replicas, self.order(replicas, minibatches))
        lists = gen.flush_sync(lists, self.microbatches) if self.flush else gen.step_sync(lists, replicas)
        return Schedule(self.name, tuple(replicas), tuple(map(tuple, lists)), self.microbatches,
                        gen.noam(replicas), stashes=self.weights == "stash")

    def check_layout(self, layout: Layout) -> None:
        """One-line ValueError when this schedule cannot run ``layout``."""
        if not self.replicable and any(r != 1 for r in layout.replicas):
            raise ValueError(f"schedule {self.name!r} runs straight pipelines only (one worker per stage); "
                             f"use 'pipedream' for replicated stages {list(layout.replicas)}")

    def policy(self, layout: Layout, stage: int) -> str:
        """The weight policy of ``stage``'s workers (:data:`pipetrain.runtime.weights.POLICIES`)."""
        if self.weights == "stash" and gen.warmup(layout.replicas, stage) == 1:
            return "live"  # one minibatch in flight: no update between its forward and backward
        return self.weights


@dataclass(frozen=True)
class _Microbatched(PipelineSchedule):
    """A flush schedule that may split each minibatch into ``microbatches`` equal slices."""

    microbatches: int = 1  # type: ignore[assignment]

    def __post_init__(self) -> None:
        _count(self.microbatches, "microbatches")


@dataclass(frozen=True)
class PipeDream(PipelineSchedule):
    """1F1B with NOAM minibatches in flight and weight stashing (PipeDream §3.3-3.4).

    Args:
        vertical_sync: every stage runs minibatch t at the weight version the input stage used for it
            (§3.4); needs one worker per stage.
    """

    name: ClassVar[str] = "pipedream"
    flush: ClassVar[bool] = False
    replicable: ClassVar[bool] = True
    weights: ClassVar[str] = "stash"
    summary: ClassVar[str] = "1F1B with NOAM in flight and weight stashing (PipeDream)"
    vertical_sync: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.vertical_sync, bool):
            raise ValueError(f"vertical_sync={self.vertical_sync!r} must be True or False")

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.pipedream_order(replicas, minibatches)

    def check_layout(self, layout: Layout) -> None:
        if self.vertical_sync and layout.world != layout.num_stages:
            raise ValueError(f"vertical_sync needs one worker per stage; this plan replicates stages "
                             f"{list(layout.replicas)}")

    def policy(self, layout: Layout, stage: int) -> str:
        return "vertical" if self.vertical_sync else super().policy(layout, stage)


@dataclass(frozen=True)
class Naive(PipelineSchedule):
    """PipeDream's order without weight stashing: the paper's ablation (§3.4)."""

    name: ClassVar[str] = "naive"
    flush: ClassVar[bool] = False
    replicable: ClassVar[bool] = True
    weights: ClassVar[str] = "naive"
    summary: ClassVar[str] = "pipedream's order without stashing (the paper's ablation)"

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.pipedream_order(replicas, minibatches)


@dataclass(frozen=True)
class GPipe(_Microbatched):
    """Every microbatch's forward, then every backward, then one update (GPipe, arXiv:1811.06965)."""

    name: ClassVar[str] = "gpipe"
    flush: ClassVar[bool] = True
    summary: ClassVar[str] = "all microbatch forwards, then backwards, then one update"

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.gpipe_order(replicas, minibatches, self.microbatches)


@dataclass(frozen=True)
class OneFOneBFlush(_Microbatched):
    """1F1B over a minibatch's microbatches, then one update (PipeDream-Flush)."""

    name: ClassVar[str] = "1f1b-flush"
    flush: ClassVar[bool] = True
    summary: ClassVar[str] = "1F1B over a minibatch's microbatches, then one update"

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.one_f_one_b_flush_order(replicas, minibatches, self.microbatches)


@dataclass(frozen=True)
class ModelParallel(PipelineSchedule):
    """One minibatch in the whole pipeline at a time."""

    name: ClassVar[str] = "model-parallel"
    flush: ClassVar[bool] = True
    summary: ClassVar[str] = "one minibatch in the pipeline at a time"

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.model_parallel_order(replicas, minibatches)


SCHEDULES: dict[str, type[PipelineSchedule]] = {c.name: c for c in (PipeDream, Naive, GPipe, OneFOneBFlush,
                                                                    ModelParallel)}
DEFAULT_SCHEDULE = PipeDream.name


# -- strategies -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Strategy:
    """A way to share training among workers.

    Class attributes (facts, not options):
        name: what ``strategy=`` says.
        data_parallel: every worker holds the whole model and takes a shard of every minibatch.
        summary: one line for help texts.
    """

    name: ClassVar[str]
    data_parallel: ClassVar[bool] = True
    summary: ClassVar[str]

    def synchronizer(self, ctx: SyncContext) -> GradSync | None:
        """This worker's gradient synchronizer (collective: every rank calls it), or None."""
        raise NotImplementedError

    def staleness_at(self, epoch: int) -> int:
        """K in ``epoch``: the minibatches a gradient is applied after (1: synchronous SGD)."""
        return 1

    def build(self, workers: int, minibatches: int, epoch: int = 0) -> Schedule:
        """A data-parallel strategy's action lists for one epoch: every worker runs every minibatch's
        shard, then the sync pass with this epoch's staleness (Pipe-SGD, Alg. 1; K = 1: synchronous)."""
        _count(workers, "workers")
        _count(minibatches, "minibatches", 0)
        lists = gen.stale_sync(gen.p2p_pass([workers], gen.data_parallel_order(workers, minibatches)),
                               self.staleness_at(epoch))
        return Schedule(self.name, (workers,), tuple(map(tuple, lists)), sharded=True)

    def check_model(self, model: nn.Module) -> None:
        """One-line ValueError when this strategy cannot train ``model``."""

    def check_host(self, model: nn.Module, local_workers: int) -> None:
        """One-line ValueError when this machine cannot hold what the strategy keeps beside the workers."""

    @property
    def changes_arithmetic(self) -> bool:
        """Does it compute something other than SGD's own sums (a lossy codec)?"""
        return False


@dataclass(frozen=True)
class Pipeline(Strategy):
    """Stages on workers, run by a :class:`PipelineSchedule` (PipeDream and others)."""

    name: ClassVar[str] = "pipeline"
    data_parallel: ClassVar[bool] = False
    summary: ClassVar[str] = "stages on workers, run by a schedule (PipeDream and others)"

    def synchronizer(self, ctx: SyncContext) -> GradSync | None:
        return replica_groups(ctx)

    def build(self, workers: int, minibatches: int, epoch: int = 0) -> Schedule:
        raise ValueError("a pipeline's action lists come from its schedule: schedule.build(replicas, minibatches)")


@dataclass(frozen=True)
class DDP(Strategy):
    """PyTorch DistributedDataParallel: synchronous, bucket allreduces inside the backward."""

    name: ClassVar[str] = "ddp"
    summary: ClassVar[str] = "PyTorch DistributedDataParallel: synchronous, allreduce inside the backward"

    def synchronizer(self, ctx: SyncContext) -> GradSync | None:
        return ddp(ctx)


@dataclass(frozen=True)
class PipeSGD(Strategy):
    """Pipe-SGD (Li et al., NeurIPS'18): the allreduce of minibatch t overlaps the compute of the next K-1.

    Args:
        staleness: K; minibatch t of an epoch takes its gradient at the weights after max(0, t-K+1)
            updates, and update j applies minibatch j-1's mean gradient (K = 2). 1 is synchronous SGD.
        compression: the codec inside the ring allreduce: None, ``"trunc16"`` (the upper 16 bits of each
            float32) or ``"quant8"`` (8 bits with a scale per group); float32 models only.
        warmup_epochs: the first epochs run with K = 1.
    """

    name: ClassVar[str] = "pipe-sgd"
    summary: ClassVar[str] = "Pipe-SGD: the allreduce of minibatch t overlaps the compute of t+1..t+K-1"
    staleness: int = 2
    compression: str | None = None
    warmup_epochs: int = 0

    def __post_init__(self) -> None:
        _count(self.staleness, "staleness")
        _count(self.warmup_epochs, "warmup_epochs", 0)
        get_codec(self.compression)  # a one-line error naming the codecs

    def synchronizer(self, ctx: SyncContext) -> GradSync | None:
        return pipe_sgd(ctx, self.compression)

    def staleness_at(self, epoch: int) -> int:
        return 1 if epoch < self.warmup_epochs else self.staleness

    def check_model(self, model: nn.Module) -> None:
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        if get_codec(self.compression).lossy and dtypes != {torch.float32}:
            raise ValueError(f"compression={self.compression!r} works on float32 gradients, but the model's "
                             f"parameters are {', '.join(sorted(str(d) for d in dtypes))}; use a float32 model "
                             "or compression=None")

    @property
    def changes_arithmetic(self) -> bool:
        return get_codec(self.compression).lossy


@dataclass(frozen=True)
class CGDP(Strategy):
    """CPU-GPU data parallel: chunks of layers summed in shared host memory while the backward goes on.

    Args:
        chunk: layers per chunk (their gradients go to host memory together), or ``"auto"``: the
            paper's run-time search (:class:`pipetrain.strategies.chunks.ChunkSearch`).
    """

    name: ClassVar[str] = "cgdp"
    summary: ClassVar[str] = ("CPU-GPU data parallel: chunks of layers summed in shared host memory during the "
                              "backward (one machine, or hierarchical)")
    chunk: int | str = "auto"

    def __post_init__(self) -> None:
        if not (self.chunk == "auto" or (isinstance(self.chunk, int) and not isinstance(self.chunk, bool)
                                         and self.chunk >= 1)):
            raise ValueError(f"chunk={self.chunk!r}: give the layers per chunk (an integer >= 1) or 'auto' "
                             "(the run-time search)")

    def synchronizer(self, ctx: SyncContext) -> GradSync | None:
        return cgdp(ctx, self.chunk)

    def check_host(self, model: nn.Module, local_workers: int) -> None:
        """Room in the machine's shared memory for its workers' gradients."""
        need = host_bytes(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
                          local_workers)
        if HOST_MEMORY.is_dir():
            st = os.statvfs(HOST_MEMORY)
            if need > st.f_bavail * st.f_frsize:
                raise ValueError(f"cgdp needs {need / 2**20:.0f} MiB of shared memory in {HOST_MEMORY} for "
                                 f"{local_workers} workers' gradients, but {st.f_bavail * st.f_frsize / 2**20:.0f} MiB "
                                 "are free; enlarge it (docker: --shm-size) or use another strategy")


@dataclass(frozen=True)
class Auto:
    """``strategy="auto"``: measure, predict every strategy and train the fastest.

    Args:
        allow_compression: may pick a codec that changes the arithmetic (Pipe-SGD's trunc16, quant8).
    """

    name: ClassVar[str] = "auto"
    summary: ClassVar[str] = ("profile, measure this machine, predict every strategy for the workers and train "
                              "the fastest")
    allow_compression: bool = False


STRATEGIES: dict[str, type[Strategy]] = {c.name: c for c in (Pipeline, DDP, PipeSGD, CGDP)}


# -- names and options ------------------------------------------------------------------------------

def as_schedule(value: str | PipelineSchedule) -> PipelineSchedule:
    """A schedule object from a name (its defaults) or the object itself."""
    if isinstance(value, PipelineSchedule):
        return value
    if not isinstance(value, str) or value not in SCHEDULES:
        raise ValueError(f"unknown schedule {value!r}; choose one of {', '.join(SCHEDULES)}, or an object such as "
                         "pipetrain.GPipe(microbatches=4)")
    return SCHEDULES[value]()


def as_strategy(value: str | Strategy | Auto) -> Strategy | Auto:
    """A strategy object from a name (its defaults) or the object itself."""
    if isinstance(value, (Strategy, Auto)):
        return value
    if value == Auto.name:
        return Auto()
    if not isinstance(value, str) or value not in STRATEGIES:
        raise ValueError(f"unknown strategy {value!r}; choose one of auto, {', '.join(STRATEGIES)}, or an object "
                         "such as pipetrain.PipeSGD(staleness=2)")
    return STRATEGIES[value]()


def make(kind: str, name: str, options: dict[str, Any]) -> Any:
    """The ``kind`` (``"strategy"`` or ``"schedule"``) ``name`` with ``options`` given by name, as the
    CLI's flags give them: an option another strategy or schedule takes is refused in one line
    naming which does take it."""
    table: dict[str, Any] = {**STRATEGIES, Auto.name: Auto} if kind == "strategy" else dict(SCHEDULES)
    cls = as_strategy(name) if kind == "strategy" else as_schedule(name)
    own = {f.name for f in fields(cls)}
    for option in options:
        if option not in own:
            takes = [n for n, c in table.items() if option in {f.name for f in fields(c)}]
            raise ValueError(f"{option} applies to {kind} {' or '.join(map(repr, takes))}, not {name!r}; leave it "
                             f"out or change the {kind}")
    return type(cls)(**options)


def from_options(strategy: str, schedule: str | None = None, **options: Any
                 ) -> tuple[Strategy | Auto, PipelineSchedule | None]:
    """The strategy and schedule objects named, each with the options (given by name, as the CLI's flags
    give them) that it takes; an option that neither takes is refused in one line naming who takes it.
    The schedule is None where neither a schedule nor an option of one is given."""
    chosen = as_strategy(strategy)
    schedule_options = {k: v for k, v in options.items() if any(k in {f.name for f in fields(c)}
                                                                 for c in SCHEDULES.values())}
    strategy_options = {k: v for k, v in options.items() if k not in schedule_options}
    made = make("strategy", strategy, strategy_options)
    if schedule is None and not schedule_options:
        return made, None
    if not isinstance(chosen, Pipeline):
        what = next(iter(schedule_options), "schedule")
        raise ValueError(f"{what} applies to strategy 'pipeline', not {chosen.name!r}; leave it out or change the "
                         "strategy")
    return made, make("schedule", schedule or DEFAULT_SCHEDULE, schedule_options)


def build_schedule(schedule: str | PipelineSchedule, replicas: Sequence[int], minibatches: int) -> Schedule:
    """The action lists of a pipeline ``schedule`` (a name or an object) over stages of ``replicas``
    workers, for ``minibatches`` minibatches."""
    return as_schedule(schedule).build(replicas, minibatches)


def build_data_parallel(strategy: str | Strategy, workers: int, minibatches: int, epoch: int = 0) -> Schedule:
    """The action lists of a data-parallel ``strategy`` (a name or an object) on ``workers`` workers."""
    chosen = as_strategy(strategy)
    if not isinstance(chosen, Strategy) or not chosen.data_parallel:
        raise ValueError(f"strategy {chosen.name!r} is not data parallel; build a pipeline with build_schedule")
    return chosen.build(workers, minibatches, epoch)

