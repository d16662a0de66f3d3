"""The pipeline schedules by name, each a small class that owns its options and builds its action lists.

A schedule's class carries the facts the runtime, validator and simulator read (whether it flushes,
its weight policy, whether stages may be replicated); its options (``GPipe(microbatches=4)``,
``PipeDream(vertical_sync=True)``) are checked when it is made.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pipetrain import costs
from pipetrain.layout import Layout
from pipetrain.schedule import generators as gen
from pipetrain.schedule import interleaved
from pipetrain.schedule.actions import Schedule


def check_count(value: Any, what: str, least: int = 1) -> None:
    """A one-line ValueError unless ``value`` is an integer of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what}={value!r} must be an integer >= {least}")


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule: the order of each worker's forwards and backwards, and when it updates.

    Class attributes (facts, not options):
        name: what ``schedule=`` says.
        flush: one update per minibatch after its last microbatch, no minibatch in flight across an
            update (live weights); else minibatches stay in flight across updates (1F1B with weight
            versions: an update after every minibatch's last backward, its sync as ``sync_pass`` places it).
        replicable: stages may be replicated (round robin over replicas).
        looped: its workers hold several stages each, round robin (``workers=W`` beside ``stages``).
        weights: the run-time weight policy (:data:`pipetrain.runtime.weights.POLICIES`).
        summary: one line for help texts.
    """

    name: ClassVar[str]
    flush: ClassVar[bool]
    replicable: ClassVar[bool] = False
    looped: ClassVar[bool] = False
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
        lists = self.sync_pass(gen.p2p_pass(replicas, self.order(replicas, minibatches)), replicas)
        return Schedule(self.name, tuple(replicas), tuple(map(tuple, lists)), self.microbatches,
                        gen.noam(replicas), stashes=self.weights in ("stash", "double"),
                        double_buffered=self.weights == "double")

    def window(self, replicas: Sequence[int], minibatches: int) -> Schedule:
        """The action lists of ``minibatches`` in a row, any count, for pricing a steady state: where the
        count leaves a stage's last round partial, that round's replicas update without a sync
        (:func:`~pipetrain.schedule.generators.unsynced_tail`). Not an epoch the runtime runs (its
        replicas join every sync), so the simulator need not run a common multiple of every stage's
        replicas (``build``) to reach a plan's steady state; what it measures leaves that tail out
        (:func:`pipetrain.predict.pipeline.steady_rate`)."""
        if minibatches % Layout(tuple(replicas)).rounds == 0:
            return self.build(replicas, minibatches)
        self.check_layout(Layout(tuple(replicas)))
        lists = self.sync_pass(gen.p2p_pass(replicas, self.order(replicas, minibatches)), replicas)
        return Schedule(self.name, tuple(replicas), tuple(map(tuple, gen.unsynced_tail(lists, replicas, minibatches))),
                        self.microbatches, gen.noam(replicas), stashes=self.weights in ("stash", "double"),
                        double_buffered=self.weights == "double")

    def sync_pass(self, lists: gen.Lists, replicas: Sequence[int]) -> gen.Lists:
        """Where each worker syncs and applies its gradients (``A``, ``S``, ``U``)."""
        return gen.flush_sync(lists, self.microbatches) if self.flush else gen.step_sync(lists, replicas)

    def check_layout(self, layout: Layout) -> None:
        """One-line ValueError when this schedule cannot run ``layout``."""
        if not self.replicable and any(r != 1 for r in layout.replicas):
            raise ValueError(f"schedule {self.name!r} runs straight pipelines only (one worker per stage); "
                             f"use 'pipedream' for replicated stages {list(layout.replicas)}")

    def world(self, layout: Layout) -> int:
        """The workers that run ``layout``'s stages."""
        return layout.world

    def placed(self, workers: int | None) -> PipelineSchedule:
        """This schedule for ``workers`` workers (``pipetrain.train``'s), where it places stages itself."""
        return self

    def policy(self, layout: Layout, stage: int) -> str:
        """The weight policy of ``stage``'s workers (:data:`pipetrain.runtime.weights.POLICIES`)."""
        if self.weights == "stash" and gen.warmup(layout.replicas, stage) == 1:
            return "live"  # one minibatch in flight: no update between its forward and backward
        return self.weights

    # The memory model (pipetrain.costs.stage_memory_bytes) asks these of a stage with ``replicas``
    # workers and ``workers_to_output`` workers from it to the output stage (its own included), as the
    # planner places it; a schedule that keeps other counts overrides them.
    def in_flight(self, replicas: int, workers_to_output: int) -> int:
        """(Micro)batches a worker of the stage holds between their forward and backward at most: 1F1B's
        ceil(workers_to_output / replicas) (NOAM at the input stage)."""
        return costs.in_flight(replicas, workers_to_output)

    def weight_versions(self, replicas: int, workers_to_output: int) -> int:
        """Weight versions a worker of the stage stashes beside its live weights: one per minibatch in
        flight with weight stashing (PipeDream's count), none when the live weights serve every backward
        (a stashing stage that holds one minibatch at a time runs on them: :meth:`policy`)."""
        held = self.in_flight(replicas, workers_to_output)
        return held if self.weights == "stash" and held > 1 else 0


@dataclass(frozen=True)
class _Microbatched(PipelineSchedule):
    """A flush schedule that may split each minibatch into ``microbatches`` equal slices."""

    microbatches: int = 1  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_count(self.microbatches, "microbatches")

    def in_flight(self, replicas: int, workers_to_output: int) -> int:
        """1F1B over the microbatches, at most all of them."""
        return min(self.microbatches, super().in_flight(replicas, workers_to_output))


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

    def weight_versions(self, replicas: int, workers_to_output: int) -> int:
        """With vertical sync, a stage keeps a version for each minibatch in flight, one in flight included."""
        if self.vertical_sync:
            return self.in_flight(replicas, workers_to_output)
        return super().weight_versions(replicas, workers_to_output)


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
class TwoBW(PipelineSchedule):
    """PipeDream-2BW (arXiv:2006.09503): 1F1B over every microbatch of every minibatch with no flush, and
    two weight versions per stage. Minibatch t (1-based, of an epoch) takes every microbatch's gradient at
    the weights after max(0, t-2) updates, at every stage, and update t applies minibatch t's mean
    gradient: W_t = W_{t-1} - lr * grad f(W_{max(0,t-2)}). Replica i of a stage of r takes minibatches
    i, i+r, ...; round q of them runs at the stage's weights after max(0, q-1) updates, each the mean
    gradient of a round.

    Args:
        microbatches: slices per minibatch; at least the number of stages, so that a stage never holds
            microbatches of more than two minibatches.
    """

    name: ClassVar[str] = "2bw"
    flush: ClassVar[bool] = False
    replicable: ClassVar[bool] = True
    weights: ClassVar[str] = "double"
    summary: ClassVar[str] = "1F1B over microbatches without a flush, two weight versions (PipeDream-2BW)"
    microbatches: int = 1  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_count(self.microbatches, "microbatches")

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.two_bw_order(replicas, minibatches, self.microbatches)

    def sync_pass(self, lists: gen.Lists, replicas: Sequence[int]) -> gen.Lists:
        return gen.deferred_sync(lists, replicas, self.microbatches)

    def weight_versions(self, replicas: int, workers_to_output: int) -> int:
        """Two copies beside the live weights: the newest version and the one before it."""
        return 2

    def check_layout(self, layout: Layout) -> None:
        super().check_layout(layout)
        if self.microbatches < layout.num_stages:
            n = layout.num_stages
            raise ValueError(f"schedule '2bw' needs microbatches >= the number of stages ({n}), got "
                             f"{self.microbatches}; use microbatches={n} or more (--microbatches {n})")


@dataclass(frozen=True)
class GPipe(_Microbatched):
    """Every microbatch's forward, then every backward, then one update (GPipe, arXiv:1811.06965)."""

    name: ClassVar[str] = "gpipe"
    flush: ClassVar[bool] = True
    summary: ClassVar[str] = "all microbatch forwards, then backwards, then one update"

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.gpipe_order(replicas, minibatches, self.microbatches)

    def in_flight(self, replicas: int, workers_to_output: int) -> int:
        """Every microbatch's forward comes before the first backward."""
        return self.microbatches


@dataclass(frozen=True)
class OneFOneBFlush(_Microbatched):
    """1F1B over a minibatch's microbatches, then one update (PipeDream-Flush)."""

    name: ClassVar[str] = "1f1b-flush"
    flush: ClassVar[bool] = True
    summary: ClassVar[str] = "1F1B over a minibatch's microbatches, then one update"

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.one_f_one_b_flush_order(replicas, minibatches, self.microbatches)


@dataclass(frozen=True)
class ZeroBubble(_Microbatched):
    """ZB-H1 (Qi et al., ICLR'24): 1F1B over a minibatch's microbatches with each backward split into
    its input gradient (``I``, sent on at once) and its weight gradient (``W``, deferred into what
    would be bubbles), then one update."""

    name: ClassVar[str] = "zero-bubble"
    flush: ClassVar[bool] = True
    summary: ClassVar[str] = "1F1B with input and weight gradients apart, weight gradients in the bubbles"

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.zero_bubble_order(replicas, minibatches, self.microbatches)

    def sync_pass(self, lists: gen.Lists, replicas: Sequence[int]) -> gen.Lists:
        return gen.split_flush_sync(lists)


@dataclass(frozen=True)
class ModelParallel(PipelineSchedule):
    """One minibatch in the whole pipeline at a time."""

    name: ClassVar[str] = "model-parallel"
    flush: ClassVar[bool] = True
    summary: ClassVar[str] = "one minibatch in the pipeline at a time"

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return gen.model_parallel_order(replicas, minibatches)

    def in_flight(self, replicas: int, workers_to_output: int) -> int:
        return 1

@dataclass(frozen=True)
class Interleaved1F1B(_Microbatched):
    """Interleaved 1F1B (Megatron-LM's virtual stages): ``workers`` workers hold the stages round robin,
    1F1B over each minibatch's microbatches, then one update (:mod:`pipetrain.schedule.interleaved`).

    Args:
        workers: the workers W; the stages (a multiple of W) go to worker s mod W. ``pipetrain.train``
            fills it from its ``workers``.
    """

    name: ClassVar[str] = "interleaved-1f1b"
    flush: ClassVar[bool] = True
    looped: ClassVar[bool] = True
    summary: ClassVar[str] = "several stages per worker, round robin; 1F1B over microbatches, then one update"
    workers: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.workers is not None:
            check_count(self.workers, "workers", 2)

    def world(self, layout: Layout) -> int:
        return self._workers()

    def placed(self, workers: int | None) -> Interleaved1F1B:
        if workers is not None and self.workers is not None and workers != self.workers:
            raise ValueError(f"workers={workers} but the schedule says workers={self.workers}; give one of them")
        return self if workers is None else replace(self, workers=workers)

    def _workers(self) -> int:
        if self.workers is None:
            raise ValueError("interleaved-1f1b needs workers=W: the stages (a multiple of W) are placed round robin "
                             "on W workers")
        return self.workers

    def check_layout(self, layout: Layout) -> None:
        super().check_layout(layout)
        interleaved.check(self._workers(), layout.num_stages, self.microbatches)

    def order(self, replicas: Sequence[int], minibatches: int) -> gen.Lists:
        return interleaved.order(self._workers(), len(replicas), minibatches, self.microbatches)

    def build(self, replicas: Sequence[int], minibatches: int) -> Schedule:
        self.check_layout(Layout(tuple(replicas)))
        if minibatches < 0:
            raise ValueError(f"need minibatches >= 0, got {minibatches}")
        lists = interleaved.p2p_pass(len(replicas), self.order(replicas, minibatches))
        return Schedule(self.name, tuple(replicas), tuple(map(tuple, lists)), self.microbatches,
                        gen.noam(replicas), looped=self._workers())
