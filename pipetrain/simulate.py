"""Discrete-event simulator: execute a Schedule's action lists with profiled costs and a link model.

The simulator runs the very action lists the runtime runs, so its timeline has the runtime's trace
format and :mod:`pipetrain.trace` draws both.

[Note: timing rules] Every worker runs its actions in order, with no gaps:

* ``F``/``B`` last the stage's forward/backward seconds (sum over its layers), divided by the
  microbatch count for microbatched schedules, and taken at 1/r of the batch on each of r workers of
  a sharded (data-parallel) schedule; a minibatch's first ``F`` on the first stage also builds its
  inputs from the dataset, on the last stage its targets, on a stage that is both both at once (the
  profile's ``inputs_s``, ``targets_s``, ``both_s``), as the runtime's workers do;
* a send (``SF``/``SB``) is asynchronous: 0 s on the sender. The transfer is queued FIFO on the
  (sender -> receiver) link, which carries one transfer at a time, each occupying it for
  ``latency + bytes / bandwidth``;
* a receive (``RF``/``RB``) lasts until its message has arrived (its record includes the wait,
  as the runtime's does);
* ``A`` starts a gradient sync and lasts 0 s; the k-th sync of a stage begins once every worker of
  the stage has started it and the stage's previous sync has ended (one sync at a time, as on a
  communication thread), and lasts the stage's sync seconds: by default
  ``latency + costs.dp_sync_bytes(|w|, m) / bandwidth`` (PipeDream §3.2's parameter-server W^m), or
  what the caller gives (e.g. Pipe-SGD's ring model, :func:`pipetrain.costs.ring_allreduce_time`);
  syncs do not compete with the pipeline's transfers for the links;
* ``S`` lasts until its sync has ended (its record includes the wait);
* ``U`` lasts ``update_s`` (default: the optimizer seconds the profile holds for the stage's layers).

[Note: run set-up] A profile that carries a measured :class:`pipetrain.runsetup.Setup` (workers on one
machine, per-message cost) changes four rules, all through :mod:`pipetrain.costs`: compute (F, B, U, on
``pipedream`` the copy of a new weight version at a stage that stashes, and in a backward after another
since the stage's last update, as microbatches have, the add of its gradients into ``.grad``: the
set-up's ``add_s_per_byte``) takes ``slowdown`` times as long (:func:`~pipetrain.costs.contended_s`), or,
where every worker's threads have cores of their own, as long as the share of the other workers
computing meanwhile makes it (:func:`~pipetrain.costs.overlap_slowdown`, found in passes: :func:`_run`); a
transfer takes the measured message latency more (between the idle and the busy one, by how much of the
time its two ends compute: :func:`_run`), and the slower of the link's and the measured seconds per
byte; a send and a receive take the CPU a message end costs from a worker with under 2 cores; a
replicated stage's sync is a ring allreduce with the measured allreduce's latency per step and the
ring's seconds per byte (the slower of it and the link's), once per bucket of its gradient
(:func:`pipetrain.strategies.allreduce.buckets`: the runtime's replicas allreduce in buckets), and its
``A``, which starts the last bucket's allreduce, takes the CPU of a message end of that bucket's bytes,
as a send does (0.5-1.3 ms per ``A`` on the demo's replicated stages, 4 workers sharing 2 cores, priced
at nothing before). Replicas whose compute varies (the set-up's ``jitter_s``) do not arrive when
simulated: a sync begins when the last of them is expected (:func:`~pipetrain.costs.last_arrival_s`,
each replica's simulated start varied by its stage's contended forward and backward).

Each link has a single sender, which issues transfers in program order, and every other time is a
max over already known times, so event times do not depend on the order in which workers are
advanced: the loop runs each worker until it blocks and repeats until all are done.
"""
from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from pipetrain import costs
from pipetrain.costs import dp_sync_bytes
from pipetrain.layers import check_boundaries
from pipetrain.profiling import Profile
from pipetrain.setup import Setup
from pipetrain.timing import torch_threads
from pipetrain.registry import STRATEGIES, build_data_parallel, lookup
from pipetrain.schedule import Schedule, validate
from pipetrain.strategies.allreduce import buckets, last_bucket_bytes
from pipetrain.strategies.compression import Codec
from pipetrain.schedule.actions import (
    BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SENDS, START_SYNC, SYNC, UPDATE, Action,
)
from pipetrain.trace import Record

COMPUTING = (FORWARD, BACKWARD, UPDATE)
"""The actions that hold a worker's core and interpreter."""


@dataclass(frozen=True)
class Link:
    """One direction of a point-to-point link: one transfer at a time, FIFO.

    Attributes:
        bandwidth_Bps: bytes per second (``math.inf``: free transfers).
        latency_s: seconds added to every transfer.
    """

    bandwidth_Bps: float = math.inf
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_Bps > 0 or not self.latency_s >= 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self.bandwidth_Bps} B/s, "
                             f"{self.latency_s} s")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds one transfer of ``nbytes`` occupies the link (PipeDream §3.2: bytes / bandwidth)."""
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class StageCost:
    """One stage's costs per minibatch, at the simulated batch size.

    Attributes:
        forward_s, backward_s: sums over the stage's layers.
        output_bytes: activations sent to the next stage (the last layer's ``activation_bytes``);
            the gradients sent back across that cut are the same size.
        stash_bytes: activations kept from forward to backward: the stage's input plus every
            layer's output (PipeDream §3.5's intermediate state, weights excluded).
        parameter_bytes: the stage's weights.
        update_s: the optimizer step on them (the profile's ``optimizer_s``; 0 if not measured).
        batching_s: building the minibatch from the dataset before its first forward: the inputs on
            the first stage, the targets on the last (:meth:`pipetrain.profiling.Profile.building_s`).
    """

    forward_s: float
    backward_s: float
    output_bytes: float
    stash_bytes: float
    parameter_bytes: int
    update_s: float = 0.0
    batching_s: float = 0.0

    def share(self, parts: int) -> StageCost:
        """The cost of 1/``parts`` of the minibatch (times, activations and the rows built scale,
        weights and their optimizer step do not)."""
        return StageCost(self.forward_s / parts, self.backward_s / parts, self.output_bytes / parts,
                         self.stash_bytes / parts, self.parameter_bytes, self.update_s, self.batching_s / parts)


def stage_costs(profile: Profile, boundaries: Sequence[int], batch_size: int | None = None) -> list[StageCost]:
    """Per-stage costs of ``profile`` cut at ``boundaries``.

    Args:
        profile: per-layer costs, measured at ``profile.batch_size``.
        boundaries: the first layer index of each stage, e.g. ``[0, 3, 7]``.
        batch_size: samples per minibatch; times and activation bytes are scaled linearly from the
            profiled batch size (an approximation: small batches use a device less well). A profile
            that does not state its batch size (0, as PipeDream's graph.txt files) is taken as
            measured at ``batch_size``.

    Returns:
        One StageCost per stage.

    Raises:
        LayerError: boundaries that do not cut the profile's layers into non-empty stages.
    """
    check_boundaries(list(boundaries), len(profile))
    scale = 1.0 if batch_size is None or profile.batch_size == 0 else batch_size / profile.batch_size
    ends = [*boundaries[1:], len(profile)]
    stages = []
    for first, end in zip(boundaries, ends):
        layers = profile.layers[first:end]
        inputs = profile.input_bytes if first == 0 else profile.layers[first - 1].activation_bytes
        stages.append(StageCost(
            forward_s=scale * sum(x.forward_s for x in layers),
            backward_s=scale * sum(x.backward_s for x in layers),
            output_bytes=scale * layers[-1].activation_bytes,
            stash_bytes=scale * (inputs + sum(x.activation_bytes for x in layers)),
            parameter_bytes=sum(x.parameter_bytes for x in layers), update_s=sum(x.optimizer_s for x in layers),
            batching_s=scale * profile.building_s(first, end)))
    return stages


@dataclass
class SimResult:
    """What a simulation predicts.

    Attributes:
        minibatches_per_s: steady-state throughput, measured as the runtime measures it: the
            minibatches of the output stage's optimizer steps after its first, over the time from its
            first step to its last. With a single step (one minibatch of a flush schedule), all
            minibatches over the makespan.
        samples_per_s: ``minibatches_per_s`` times the batch size; None when the batch size is unknown.
        makespan_s: when the last worker finishes.
        busy_fraction: per worker, compute (F and B) seconds / makespan.
        bubble_fraction: 1 - mean busy fraction; for GPipe with equal stages and free communication
            this is the GPipe paper's (p - 1) / (m + p - 1) (arXiv:1811.06965 §2.2).
        peak_weight_versions: per worker, the most distinct weight versions held for minibatches
            in flight (weight stashing, PipeDream §3.4); 1 for schedules that do not stash.
        peak_activation_bytes: per worker, the most activation bytes stashed for (micro)batches in
            flight (PipeDream §3.5).
        trace: per worker, ``(action_text, start_s, end_s)`` records, the runtime's trace format.
    """

    minibatches_per_s: float
    samples_per_s: float | None
    makespan_s: float
    busy_fraction: list[float]
    bubble_fraction: float
    peak_weight_versions: list[int]
    peak_activation_bytes: list[float]
    trace: list[list[Record]] = field(repr=False)

    def to_dict(self) -> dict[str, object]:
        """Every field but the trace, as plain JSON-ready data."""
        return {"minibatches_per_s": self.minibatches_per_s, "samples_per_s": self.samples_per_s,
                "makespan_s": self.makespan_s,
                "busy_fraction": self.busy_fraction, "bubble_fraction": self.bubble_fraction,
                "peak_weight_versions": self.peak_weight_versions,
                "peak_activation_bytes": self.peak_activation_bytes}


def _link_terms(link: Link, setup: Setup | None, allreduce: str | None = None,
                idle: bool = False, nbytes: float | None = None) -> tuple[float, float]:
    """(latency, seconds per byte) of one message on ``link``, or with ``allreduce`` (``"ours"``: our
    ring, ``"backend"``: the backend's ``all_reduce``) of one step of an allreduce of a gradient of
    ``nbytes``: with a measured set-up, its message (allreduce) latency more, at the slower of the
    link's and the measured transport's (allreduce's) seconds per byte (see [Note: run set-up] and
    :meth:`pipetrain.runsetup.Setup.allreduce_terms`); ``idle``: our ring's as measured with nothing
    else running, where it was."""
    if setup is None:
        return link.latency_s, 1 / link.bandwidth_Bps
    latency, per_byte = (setup.latency_s, setup.s_per_byte) if allreduce is None else \
        setup.allreduce_terms(ours=allreduce == "ours", idle=idle, nbytes=nbytes)
    return link.latency_s + latency, max(1 / link.bandwidth_Bps, per_byte)


class _Sim:
    """The mutable state of one simulation; see [Note: timing rules]."""

    def __init__(self, schedule: Schedule, stages: list[StageCost], link: Link,
                 update_s: Sequence[float] | None, sync_s: Sequence[float] | None, setup: Setup | None,
                 contention: float, shares: Sequence[float] | None = None,
                 others: Sequence[Sequence[float]] | None = None) -> None:
        self.sched, self.costs, self.link, self.setup = schedule, stages, link, setup
        self.shares = shares  # each worker's share of the time computing, from a pass before (None: all)
        self.others = others  # per worker and action, the other workers' share computing meanwhile (None: all)
        self.slowdown = 1.0 if setup is None else setup.slowdown
        # the part of slowdown that is all the workers computing at once (the rest: a step over its layers)
        self.contention = contention
        # a given update_s (per stage) is taken as the time it takes; the profile's is the optimizer alone
        self.update_s = None if update_s is None else list(update_s)
        n = schedule.num_workers
        self.pos, self.clock = [0] * n, [0.0] * n
        self.trace: list[list[Record]] = [[] for _ in range(n)]
        # (dst, recv kind, mb, micro) -> (arrival, bytes)
        self.arrival: dict[tuple[int, str, int, int | None], tuple[float, float]] = {}
        self.link_free: dict[tuple[int, int], float] = defaultdict(float)
        self.sync_started: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)  # (stage, k) -> w: t
        self.sync_end: dict[tuple[int, int], float] = {}  # (stage, k) -> when the k-th sync ended
        self.starts, self.waits, self.updates = [0] * n, [0] * n, [0] * n
        self.stashes = schedule.stashes
        self.busy_s = [0.0] * n
        self.compute_s = [0.0] * n  # F, B and U: what holds a worker's core and interpreter
        self.update_end: list[list[float]] = [[] for _ in range(n)]
        self.last_backward = [0.0] * n
        self.versions: list[dict[int, int]] = [{} for _ in range(n)]  # in-flight mb -> version its F saw
        self.in_flight = [0] * n  # (micro)batches between F and B
        self.peak_versions, self.peak_in_flight = [1] * n, [0] * n
        # PipeDream §3.2's W^m: the parameter-server volume over one link; nothing for one replica
        self.latency_s, self.byte_s = _link_terms(link, setup)
        self.sync_s = list(sync_s) if sync_s is not None else [
            0.0 if r == 1 else link.transfer_s(dp_sync_bytes(c.parameter_bytes, r)) if setup is None else
            costs.ring_allreduce_time(r, c.parameter_bytes,
                                      *_link_terms(link, setup, allreduce="backend", nbytes=c.parameter_bytes), 0.0,
                                      segments=buckets(c.parameter_bytes))
            for c, r in zip(stages, schedule.replicas)]
        self.start_sync_s = [0.0 if r == 1 else self._cpu_s(last_bucket_bytes(c.parameter_bytes))
                             for c, r in zip(stages, schedule.replicas)]
        self.jitter_s = 0.0 if setup is None else setup.jitter_s
        self.work_s = [costs.contended_s(c.forward_s + c.backward_s, self.slowdown) for c in stages]
        # the output stage never holds two minibatches, so it runs without stashed copies (runtime.job)
        self.copy_s = [c.parameter_bytes * setup.copy_s_per_byte if self.stashes and setup is not None and
                       s < len(stages) - 1 else 0.0 for s, c in enumerate(stages)]
        # a backward after another since the last update adds its gradients into .grad (microbatches)
        self.add_s = [0.0 if setup is None else c.parameter_bytes * setup.add_s_per_byte for c in stages]
        self.grads_held = [False] * n

    def _transfer_s(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds one message from ``src`` to ``dst`` occupies its link (see [Note: run set-up])."""
        if self.setup is None:
            return self.link.transfer_s(nbytes)
        latency = self.latency_s
        if self.shares is not None:
            latency = self.link.latency_s + costs.busy_latency_s(
                self.setup.idle_latency_s, self.setup.latency_s, (self.shares[src], self.shares[dst]))
        return costs.message_time(nbytes, latency, self.byte_s)

    def _cpu_s(self, nbytes: float) -> float:
        """Compute seconds one message end takes from its worker (see [Note: run set-up])."""
        return 0.0 if self.setup is None else self.setup.shared_cpu(nbytes)

    def run(self) -> None:
        acts = self.sched.actions
        while any(p < len(a) for p, a in zip(self.pos, acts)):
            moved = False
            for w in range(len(acts)):
                while self.pos[w] < len(acts[w]) and self._step(w, acts[w][self.pos[w]]):
                    moved = True
            if not moved:  # validate() rules this out; guard against a simulator bug looping forever
                raise RuntimeError(f"simulation of {self.sched.name!r} stalled at steps {self.pos}")

    def _step(self, w: int, a: Action) -> bool:
        """Run ``a`` on worker ``w`` if it can start; False if it waits on another worker."""
        start = self.clock[w]
        end = self._end(w, a, start)
        if end is None:
            return False
        self.trace[w].append((str(a), start, end))
        self.clock[w] = end
        self.pos[w] += 1
        self._account(w, a, end - start)
        return True

    def _end(self, w: int, a: Action, start: float) -> float | None:
        s, m = self.sched.stage_of(w), self.sched.microbatches
        if a.kind == FORWARD:
            first = a.micro in (None, 0)  # builds the minibatch; may make a new weight version
            copy = self.copy_s[s] if first and self.updates[w] not in self.versions[w].values() else 0.0
            build = self.costs[s].batching_s if first else 0.0
            return start + self._compute_s(w, self.costs[s].forward_s / m + copy + build)
        if a.kind == BACKWARD:
            add = self.add_s[s] if self.grads_held[w] else 0.0
            return start + self._compute_s(w, self.costs[s].backward_s / m + add)
        if a.kind in SENDS:
            dst = self.sched.peer(w, a)
            assert dst is not None
            cut = s if a.kind == SEND_ACT else s - 1  # gradients cross the cut after the previous stage
            nbytes = self.costs[cut].output_bytes / m
            begin = max(start, self.link_free[(w, dst)])
            self.link_free[(w, dst)] = begin + self._transfer_s(nbytes, w, dst)
            self.arrival[(dst, SENDS[a.kind], a.mb, a.micro)] = (self.link_free[(w, dst)], nbytes)
            return start + self._cpu_s(nbytes)
        if a.kind in (RECV_ACT, RECV_GRAD):
            got = self.arrival.pop((w, a.kind, a.mb, a.micro), None)
            return None if got is None else max(start, got[0]) + self._cpu_s(got[1])
        if a.kind == START_SYNC:
            k = self.starts[w]
            started = self.sync_started[(s, k)]
            started[w] = start + self.start_sync_s[s]
            if len(started) == self.sched.replicas[s]:  # the last worker in starts it
                last = costs.last_arrival_s(list(started.values()), self.work_s[s], self.jitter_s)
                self.sync_end[(s, k)] = max(last, self.sync_end.get((s, k - 1), 0.0)) + self.sync_s[s]
            return started[w]
        if a.kind == SYNC:
            end = self.sync_end.get((s, self.waits[w]))
            return None if end is None else max(start, end)
        assert a.kind == UPDATE
        return start + (self._compute_s(w, self.costs[s].update_s) if self.update_s is None else self.update_s[s])

    def _compute_s(self, w: int, seconds: float) -> float:
        """How long ``seconds`` of compute alone take as worker ``w``'s next action: ``slowdown`` times as
        long; where the pass before found the others' share computing meanwhile, the contention part of
        it at that share (:func:`pipetrain.costs.overlap_slowdown`), times the rest."""
        if self.others is None:
            return costs.contended_s(seconds, self.slowdown)
        shared = costs.overlap_slowdown(self.contention, self.others[w][self.pos[w]])
        return costs.contended_s(seconds, self.slowdown / self.contention * shared)

    def others_computing(self) -> list[list[float]]:
        """Per worker and action of this pass, the mean share of the other workers computing (F, B, U)
        during it: 1 for an action of no length or with no other worker."""
        n = self.sched.num_workers
        events = sorted((t, step) for w in range(n) for a, (_, start, end) in zip(self.sched.actions[w], self.trace[w])
                        if a.kind in COMPUTING and end > start for t, step in ((start, 1), (end, -1)))
        times, integral, counts = [0.0], [0.0], [0]  # the number computing from times[i] on; its integral to it
        for t, step in events:
            integral.append(integral[-1] + counts[-1] * (t - times[-1]))
            times.append(t)
            counts.append(counts[-1] + step)

        def area(t: float) -> float:
            i = bisect.bisect_right(times, t) - 1
            return integral[i] + counts[i] * (t - times[i])

        return [[((area(end) - area(start)) / (end - start) - 1) / (n - 1) if end > start and n > 1 else 1.0
                 for _, start, end in self.trace[w]] for w in range(n)]

    def _account(self, w: int, a: Action, seconds: float) -> None:
        """Track busy time, syncs, updates, in-flight minibatches and the weight versions they hold."""
        if a.kind in (FORWARD, BACKWARD):
            self.busy_s[w] += seconds
        if a.kind in COMPUTING:
            self.compute_s[w] += seconds
        if a.kind == BACKWARD:
            self.last_backward[w] = self.clock[w]
            self.grads_held[w] = True
        if a.kind == START_SYNC:
            self.starts[w] += 1
        elif a.kind == SYNC:
            self.waits[w] += 1
        elif a.kind == UPDATE:
            self.updates[w] += 1
            self.grads_held[w] = False
            self.update_end[w].append(self.clock[w])
        elif a.kind == FORWARD:
            self.in_flight[w] += 1
            self.peak_in_flight[w] = max(self.peak_in_flight[w], self.in_flight[w])
            if a.micro in (None, 0):
                self.versions[w][a.mb] = self.updates[w]
                if self.stashes:  # only a stashing schedule holds a version per minibatch
                    self.peak_versions[w] = max(self.peak_versions[w], len(set(self.versions[w].values())))
        elif a.kind == BACKWARD:
            self.in_flight[w] -= 1
            if a.micro in (None, self.sched.microbatches - 1):
                del self.versions[w][a.mb]


def simulate(schedule: Schedule, profile: Profile, boundaries: Sequence[int], link: Link = Link(),
             batch_size: int | None = None, update_s: float | None = None,
             sync_s: Sequence[float] | None = None) -> SimResult:
    """Predict a schedule's timeline and throughput from a profile and a link model.

    Args:
        schedule: the action lists to execute (``build_schedule(...)``).
        profile: per-layer costs.
        boundaries: the first layer index of each stage; one per stage of ``schedule``.
        link: every point-to-point link direction, and the link used for gradient syncs.
        batch_size: samples per minibatch (default: the profile's); costs scale linearly with it
            (see :func:`stage_costs`); a sharded schedule's workers each take 1/r of it.
        update_s: seconds per optimizer step of every stage, as given (default: each stage's from the
            profile, contended as [Note: run set-up] says).
        sync_s: seconds one gradient sync of each stage takes (default: PipeDream's W^m, see
            [Note: timing rules]).

    The profile's measured set-up, if it has one, changes the rules as [Note: run set-up] says. A
    schedule of one stage that is not sharded (each replica trains on whole minibatches), and every
    stage of a schedule that runs microbatches, take their forward's and backward's slowdown from the
    set-up's training step when that step was of a microbatch's rows (a whole minibatch without
    microbatches): the whole model's step over its layers' sum (:func:`_shard_priced`, one share per
    microbatch); their updates keep the set-up's own slowdown. For one stage the step is exactly what
    each replica runs, timed in the workers all at once; for microbatches a layer profile summed
    under-reads what a microbatch costs. sim_vs_real's wide MLP at 64 rows: its layers
    summed to 37.7 ms, the step read 42.5 all at once (slowdown 1.01), its two stages replayed alone
    in the runtime 42.3, and gpipe and 1f1b-flush priced from the layer profile read 4-26% high over
    four runs; at 256 rows the layers, the step and the replay agreed within 3%.

    Returns:
        The predicted SimResult; see [Note: timing rules] for how each action is timed.

    Raises:
        ValueError: boundaries that do not fit the schedule or the profile.
        ScheduleError: a schedule that deadlocks or whose sends and receives do not match.
    """
    if len(boundaries) != schedule.num_stages:
        raise ValueError(f"{len(boundaries)} stage boundaries for a {schedule.num_stages}-stage schedule; "
                         "give the first layer of every stage")
    validate(schedule)  # clear errors for a bad schedule before timing it
    batch = profile.batch_size if batch_size is None else batch_size
    if sync_s is not None and len(sync_s) != schedule.num_stages:
        raise ValueError(f"{len(sync_s)} sync times for a {schedule.num_stages}-stage schedule; give one per stage")
    per_stage = stage_costs(profile, boundaries, batch_size)
    updates = None if update_s is None else [update_s] * schedule.num_stages
    contention = 1.0 if profile.setup is None else profile.setup.slowdown  # before a step's slowdown replaces it
    if schedule.sharded:  # each of r workers computes on its 1/r of the minibatch
        per_stage = [c.share(schedule.replicas[0]) for c in per_stage]
    elif profile.setup is not None and (schedule.num_stages == 1 or schedule.microbatches > 1):
        # the whole model on whole minibatches, or stages that run microbatches: priced from the step at a
        # microbatch's rows; the update keeps the set-up's slowdown, as in predict_data_parallel
        if update_s is None:
            updates = [costs.contended_s(c.update_s, profile.setup.slowdown) for c in per_stage]
        profile = _shard_priced(profile, stage_costs(profile, [0], batch_size)[0], schedule.microbatches,
                                batch_size)[0]
        per_stage = stage_costs(profile, boundaries, batch_size)  # its building keeps the set-up's slowdown
    sim = _run(schedule, per_stage, link, updates, sync_s, profile.setup, contention)
    makespan = max(sim.clock, default=0.0)
    busy = [b / makespan if makespan > 0 else 0.0 for b in sim.busy_s]
    scale = [c.stash_bytes / schedule.microbatches for c in sim.costs]
    rate = _minibatches_per_s(schedule, sim.update_end, sim.last_backward, makespan)
    return SimResult(
        minibatches_per_s=rate, samples_per_s=rate * batch if batch > 0 else None,
        makespan_s=makespan, busy_fraction=busy, bubble_fraction=1.0 - sum(busy) / len(busy),
        peak_weight_versions=sim.peak_versions,
        peak_activation_bytes=[p * scale[schedule.stage_of(w)] for w, p in enumerate(sim.peak_in_flight)],
        trace=sim.trace)


SHARE_PASSES = 8
"""At most this many passes find the workers' compute shares a message's latency follows (:func:`_run`)."""


def _run(schedule: Schedule, stages: list[StageCost], link: Link, update_s: Sequence[float] | None,
         sync_s: Sequence[float] | None, setup: Setup | None, contention: float) -> _Sim:
    """The simulation run to its end, in passes where what a pass prices follows the pass before.

    * With a set-up that measured a message idle as well as busy, each message's latency follows how
      much of the time its two ends compute (:func:`pipetrain.costs.busy_latency_s`).
    * Where every worker's threads have cores of their own and the set-up's ``contention`` (its
      slowdown of all the workers computing at once, part of ``setup.slowdown`` where a step priced
      the stages) exceeds 1, each compute action's slowdown follows the share of the other workers
      computing meanwhile (:func:`pipetrain.costs.overlap_slowdown`): a pipeline's bubbles leave a
      stage the machine to itself. Where workers share cores, time slicing makes that share matter in
      ways the set-up does not measure, and compute keeps the whole slowdown.

    The first pass prices every message busy and all compute at the whole slowdown; each pass after
    takes the shares from the one before, averaged with those it was given (a longer latency lowers
    the shares that priced it, so the undamped passes swing), until the makespan moves less than 0.1%
    or :data:`SHARE_PASSES` passes. A schedule of one stage runs one pass."""
    sim = _Sim(schedule, stages, link, update_s, sync_s, setup, contention)
    sim.run()
    if setup is None or schedule.num_stages == 1:
        return sim
    latency_follows = setup.idle_latency_s > 0
    compute_follows = contention > 1 and setup.cores >= setup.workers * setup.threads
    if not (latency_follows or compute_follows):
        return sim
    shares: list[float] | None = None
    others: list[list[float]] | None = None
    for _ in range(SHARE_PASSES - 1):
        makespan = max(sim.clock, default=0.0)
        if latency_follows:
            measured = [c / makespan if makespan > 0 else 0.0 for c in sim.compute_s]
            shares = measured if shares is None else [(a + b) / 2 for a, b in zip(shares, measured)]
        if compute_follows:
            found = sim.others_computing()
            others = found if others is None else [[(a + b) / 2 for a, b in zip(mine, new)]
                                                   for mine, new in zip(others, found)]
        sim = _Sim(schedule, stages, link, update_s, sync_s, setup, contention, shares, others)
        sim.run()
        if abs(max(sim.clock, default=0.0) - makespan) <= 1e-3 * makespan:
            break
    return sim


def _minibatches_per_s(schedule: Schedule, update_end: list[list[float]], last_backward: list[float],
                       makespan: float) -> float:
    """Minibatches/s between the output stage's first and last optimizer steps (see SimResult).

    Steps after the first that follows the last backward are a drain (Pipe-SGD's last K-1 updates
    run back to back at the end) and would overstate the steady rate, so the interval ends before them.
    """
    last = schedule.num_stages - 1
    w = schedule.first_worker(last)
    drained = sum(t >= last_backward[w] for t in update_end[w])
    steps = update_end[w][:len(update_end[w]) - max(0, drained - 1)]
    if len(steps) >= 2 and steps[-1] > steps[0]:
        # one step of a replicated stage applies the minibatches of all its replicas (of a sharded
        # stage, one minibatch split over them)
        per_step = 1 if schedule.sharded else schedule.replicas[last]
        return (len(steps) - 1) * per_step / (steps[-1] - steps[0])
    minibatches = len({a.mb for acts in schedule.actions for a in acts})
    return minibatches / makespan if makespan > 0 else math.inf


@dataclass
class DataParallelPrediction:
    """What :func:`predict_data_parallel` predicts for a data-parallel strategy.

    Attributes:
        samples_per_s: from the simulator run over the strategy's own action lists.
        formula_samples_per_s: from the paper's closed form: Pipe-SGD eq. 4/5 for K >= 2, eq. 2 for
            synchronous SGD (K = 1, and ddp).
        scaling_efficiency: Pipe-SGD eq. 7, (l_up + l_comp) / max(l_up + l_comp, l_comm).
        compute_s, update_s, comm_s: one worker's forward + backward on its shard (building the shard
            from the dataset included), optimizer step
            (with the allreduce's CPU when it shares the worker's cores), and one gradient allreduce
            (Pipe-SGD's ring model, eq. 5's communication term).
        payload_bytes: the gradient as the ring sends it (after compression).
        bound: ``"compute"`` or ``"communication"``, whichever is slower per iteration.
        sim: the simulator's full result (trace, busy fractions).
    """

    samples_per_s: float
    formula_samples_per_s: float
    scaling_efficiency: float
    compute_s: float
    update_s: float
    comm_s: float
    payload_bytes: int
    bound: str
    sim: SimResult = field(repr=False)

    def to_dict(self) -> dict[str, object]:
        """Every field but the simulator's result, plus its busy fractions, as JSON-ready data."""
        return {"samples_per_s": self.samples_per_s, "formula_samples_per_s": self.formula_samples_per_s,
                "scaling_efficiency": self.scaling_efficiency, "compute_s": self.compute_s,
                "update_s": self.update_s, "comm_s": self.comm_s, "payload_bytes": self.payload_bytes,
                "bound": self.bound, "busy_fraction": self.sim.busy_fraction}


def predict_data_parallel(profile: Profile, strategy: str, workers: int, link: Link, batch_size: int | None = None,
                          staleness: int | None = None, compression: str | None = None,
                          update_s: float | None = None, reduce_s: float | None = None,
                          comm_cpu_s: float | None = None, cores_per_worker: float | None = None,
                          minibatches: int = 32) -> DataParallelPrediction:
    """Predict a data-parallel strategy's throughput from a profile (Pipe-SGD §3.1, eq. 2-7).

    Every worker runs the whole model on batch/``workers`` samples; one gradient allreduce is a ring
    over ``workers`` (:func:`pipetrain.costs.ring_allreduce_time`, with ``link``'s latency and
    bandwidth and the codec's payload bytes), one at a time on a communication thread.

    Args:
        profile: per-layer costs of the whole model.
        strategy: a data-parallel :data:`pipetrain.registry.STRATEGIES` name.
        workers: p.
        link: each worker's link (α = latency, β = 1 / bandwidth).
        batch_size: samples per minibatch of the whole job (default: the profile's).
        staleness: K for pipe-sgd (default 2); synchronous strategies use 1.
        compression: the codec inside pipe-sgd's ring.
        update_s: seconds per optimizer step (default: the profile's optimizer seconds).
        reduce_s: seconds of codec arithmetic per allreduce (γ's total); default measured here with
            :func:`pipetrain.strategies.ring.ring_compute_seconds`, with a measured set-up as slow as
            its other compute, less the plain adds a measured ring's seconds per byte already hold.
        comm_cpu_s, cores_per_worker: CPU seconds one allreduce costs a worker, and the cores each
            worker has: with fewer than 2, a stale strategy's compute side carries that CPU too
            (:func:`pipetrain.costs.shared_core_compute_s`; the simulator charges it to ``U``). Default:
            from the profile's measured set-up (our ring's CPU alone with the codec at this gradient,
            :meth:`~pipetrain.runsetup.Setup.codec_ring_cpu`, where measured, else the plain ring's,
            :meth:`~pipetrain.runsetup.Setup.ring_cpu`, and the codec's arithmetic beyond its adds;
            then the mean), else 0 and unlimited. Where the set-up timed pipe-sgd's own loop at this
            gradient, codec and workers (workers sharing cores: :meth:`~pipetrain.runsetup.Setup.period`)
            and K >= 2, neither given, an iteration is that loop's time, the update and the mean added
            (:func:`pipetrain.costs.shared_core_period_s`), as ``comm_s``, and no CPU is charged apart.

    With a measured set-up in the profile, compute takes its ``slowdown`` times as long, every ring
    step the measured allreduce's latency more (our ring's for pipe-sgd, the backend's for ddp), at the
    slower of the link's and the measured ring's seconds per byte (our ring's between its line measured
    idle, or timed idle at the job's gradient and codec, and busy, by how long the workers compute
    beside it: :func:`pipetrain.costs.overlapped_ring_s`), pipe-sgd's update its copy of the gradient
    out of ``.grad``, and its allreduce the division of the sum into the mean (the set-up's
    ``add_s_per_byte`` over the gradient, on the communication thread). ``ddp`` waits after its backward
    only for what its bucket allreduces during the backward did not finish (``comm_s`` stays one
    allreduce of the whole gradient).
        minibatches: how many the simulator runs (its rate is taken between the first and last update).

    Raises:
        ValueError: an unknown or non-data-parallel strategy, or options it does not take.
    """
    from pipetrain.strategies.compression import get_codec
    from pipetrain.strategies.ring import block_size, ring_compute_seconds

    spec = lookup(STRATEGIES, strategy, "strategy")
    if not spec.data_parallel:
        raise ValueError(f"strategy {strategy!r} is not data parallel; simulate a pipeline with --plan or --stages")
    if (staleness is not None and not spec.stale) or (compression is not None and not spec.compresses):
        raise ValueError(f"strategy {strategy!r} takes no staleness or compression; those are pipe-sgd's")
    k = (2 if staleness is None else staleness) if spec.stale else 1
    codec = get_codec(compression)
    batch = profile.batch_size if batch_size is None else batch_size
    [whole] = stage_costs(profile, [0], batch_size)
    setup = profile.setup
    slowdown = 1.0 if setup is None else setup.slowdown
    priced, shard_slowdown = _shard_priced(profile, whole, workers, batch_size)
    # a worker builds its shard of the minibatch, then runs its forward and backward on it
    build_s = costs.contended_s(whole.batching_s / workers, slowdown)
    compute_s = costs.contended_s((whole.forward_s + whole.backward_s) / workers, shard_slowdown) + build_s
    if update_s is None:  # as the simulator does: a caller's update_s is taken as given
        update_s = costs.contended_s(whole.update_s, slowdown)
    elements = whole.parameter_bytes // 4  # float32 gradients
    payload = workers * codec.payload_bytes(block_size(elements, workers, codec.granule), torch.float32)
    # workers sharing cores: the set-up may have timed this job's own loop (a step, the ring of the one
    # before beside it), which holds what their compute, ring and codec take from each other
    period = None if setup is None or not spec.compresses or k < 2 or comm_cpu_s is not None or \
        cores_per_worker is not None else setup.period(codec.name, workers, whole.parameter_bytes)
    with torch_threads(None if setup is None else setup.threads):  # as a worker's communication thread runs it
        arithmetic = ring_compute_seconds(codec, elements, workers) \
            if period is None and (reduce_s is None or comm_cpu_s is None) else 0.0
        # beyond the plain adds, which a measured ring's seconds per byte and CPU hold already
        plain = arithmetic if not codec.lossy or not arithmetic else \
            ring_compute_seconds(get_codec(None), elements, workers)
    extra = max(0.0, arithmetic - plain)
    if reduce_s is None:
        reduce_s = costs.contended_s(arithmetic if setup is None or setup.ring_s_per_byte == 0 else extra, slowdown)
    gamma = reduce_s / ((workers - 1) / workers * payload) if workers > 1 else 0.0
    latency, byte_s = _link_terms(link, setup, allreduce="ours" if spec.compresses else "backend",
                                  nbytes=whole.parameter_bytes)
    # the link's own ring time: no prediction from a set-up's timings is faster than that
    link_ring_s = costs.ring_allreduce_time(workers, payload, *_link_terms(link, None), 0.0)
    if spec.compresses and setup is not None:  # our ring's A copies the gradient out of .grad on the compute thread
        update_s += costs.contended_s(whole.parameter_bytes * setup.copy_s_per_byte, slowdown)
    # after our ring, its thread divides the sum by p: one pass over the gradient, priced as an add
    mean_s = whole.parameter_bytes * setup.add_s_per_byte if spec.compresses and setup is not None else 0.0
    if period is not None:  # the update, its copy and the mean compete for the same cores: they add to it
        # the loop's step did not build its shard of the minibatch: that adds to it too
        comm_s = float(costs.shared_core_period_s(period + build_s, update_s, costs.contended_s(mean_s, slowdown),
                                                  link_ring_s))
        comm_cpu_s = 0.0
    else:
        ring_s = costs.ring_allreduce_time(workers, payload, latency, byte_s, gamma)
        if spec.compresses and setup is not None:
            # busy while the workers compute beside it (K >= 2), idle after: the job's own ring as the
            # set-up timed it idle (no faster than the link allows), else the idle line
            timed = setup.idle_ring(codec.name, workers, whole.parameter_bytes)
            idle_s = costs.ring_allreduce_time(workers, payload, *_link_terms(link, setup, "ours", idle=True),
                                               gamma) if timed is None else max(timed, link_ring_s)
            ring_s = costs.overlapped_ring_s(idle_s, ring_s, update_s + compute_s if k > 1 else 0.0)
        comm_s = ring_s + costs.contended_s(mean_s, slowdown) if workers > 1 else 0.0
    if comm_cpu_s is None:  # CPU seconds of the ring's messages and adds, the codec's work and the mean
        comm_cpu_s = 0.0 if setup is None else mean_s + _priced_ring_cpu_s(
            setup, codec, workers, whole.parameter_bytes, payload, extra if setup.ring_cpu_s > 0 else arithmetic)
    if cores_per_worker is None:
        cores_per_worker = math.inf if setup is None else setup.cores_per_worker
    # synchronous SGD waits for the allreduce anyway (eq. 2), so its CPU only counts for K >= 2
    step_s = costs.shared_core_compute_s(update_s, 0.0, comm_cpu_s, cores_per_worker, slowdown) if k > 1 else update_s
    # DDP allreduces its buckets during the backward: only what is left after it waits
    waited_s = _ddp_waited_s(profile, whole, workers, shard_slowdown, latency, byte_s) \
        if strategy == "ddp" and workers > 1 else comm_s
    sim = simulate(build_data_parallel(strategy, workers, minibatches, k), priced, [0], link, batch_size,
                   step_s, sync_s=[waited_s])
    per_iteration = costs.pipe_sgd_time(1, step_s, compute_s, comm_s) if k > 1 else \
        costs.sync_sgd_time(1, update_s, compute_s, waited_s)
    return DataParallelPrediction(
        samples_per_s=sim.samples_per_s or 0.0,
        formula_samples_per_s=float(batch / per_iteration) if batch else 0.0,
        scaling_efficiency=float(costs.scaling_efficiency(step_s, compute_s, comm_s)), compute_s=compute_s,
        update_s=step_s, comm_s=comm_s, payload_bytes=payload,
        bound="compute" if step_s + compute_s >= comm_s else "communication", sim=sim)


def _priced_ring_cpu_s(setup: Setup, codec: Codec, workers: int, gradient_bytes: int, payload: int,
                       arithmetic_s: float) -> float:
    """CPU seconds one rank spends in our ring allreduce of ``gradient_bytes`` over ``workers`` with
    ``codec`` (``payload`` bytes of blocks in all): as the set-up measured that ring, where it did
    (:meth:`~pipetrain.runsetup.Setup.codec_ring_cpu`), else the plain ring's CPU at the payload's
    blocks and ``arithmetic_s`` (the codec's work beyond what that holds)."""
    measured = setup.codec_ring_cpu(codec.name, workers, gradient_bytes) if codec.lossy else None
    return measured if measured is not None else setup.ring_cpu(workers, payload / workers) + arithmetic_s


def _ddp_waited_s(profile: Profile, whole: StageCost, workers: int, slowdown: float, latency_s: float,
                  byte_s: float) -> float:
    """Seconds a DDP worker waits for its allreduces after its own backward: its buckets
    (:data:`pipetrain.strategies.ddp.BUCKET_BYTES`, the first one smaller), in backward order, each
    allreduced (a ring) as soon as the backward has made it, one at a time
    (:func:`pipetrain.costs.overlapped_backward_s`)."""
    from pipetrain.strategies.ddp import BUCKET_BYTES, FIRST_BUCKET_BYTES

    mine = _shard_backward_s(profile, whole, workers, slowdown)
    bp: list[float] = []
    sizes: list[int] = []
    pending_s, pending_bytes = 0.0, 0
    for layer, seconds in zip(reversed(profile.layers), reversed(mine)):
        pending_s += seconds
        pending_bytes += layer.parameter_bytes
        if pending_bytes >= (FIRST_BUCKET_BYTES if not sizes else BUCKET_BYTES):
            bp.append(pending_s)
            sizes.append(pending_bytes)
            pending_s, pending_bytes = 0.0, 0
    if pending_bytes:
        bp.append(pending_s)
        sizes.append(pending_bytes)
        pending_s = 0.0
    allreduce = [float(costs.ring_allreduce_time(workers, n, latency_s, byte_s, 0.0)) for n in sizes]
    return costs.overlapped_backward_s(bp, allreduce, pending_s) - sum(mine)


def _shard_priced(profile: Profile, whole: StageCost, workers: int, batch_size: int | None) -> tuple[Profile, float]:
    """``profile`` with its set-up's ``slowdown`` as a worker's share of the minibatch measured it, and
    that slowdown: the set-up's training step at the share's rows (:attr:`pipetrain.runsetup.Setup.step_s`,
    timed in the workers, all at once) over the forward + backward of ``whole`` (the profile as one
    stage) split ``workers`` ways (a data-parallel worker's shard; a schedule's microbatches; 1: a
    worker that trains on whole minibatches, as a one-stage pipeline's replicas do). Unchanged without
    a step of those rows (slowdown 1 without a set-up). Building a minibatch from the dataset is not
    part of the step: the profile's times of building it are rescaled so that the new slowdown
    prices them at the set-up's own.

    Ours: a CPU runs a smaller batch less well, and a layer profile taken in a few seconds of one
    process reads a VM's faster and slower phases; the step, timed in the workers themselves over
    several rounds, varied less (lstm-lm on 2 workers, six set-ups in a row: the profile's share
    75.7-98.7 ms, the step 89.5-98.8 ms; the demo's profile 6.2-9.2 ms per minibatch in five runs, its
    step on 4 workers 13.6-18.3 ms, and its one-stage plan's predictions 3388-5005 samples/s from the
    profile, 3949-4681 from the step, against 3788-4200 measured)."""
    setup = profile.setup
    if setup is None:
        return profile, 1.0
    batch = profile.batch_size if batch_size is None else batch_size
    share = (whole.forward_s + whole.backward_s) / workers
    if setup.step_s <= 0 or setup.step_rows * workers != batch or share <= 0:
        return profile, setup.slowdown
    slowdown = setup.step_s / share
    keep = setup.slowdown / slowdown  # building a minibatch is not the step: it keeps the set-up's slowdown
    return replace(profile.building_scaled(keep), setup=replace(setup, slowdown=slowdown)), slowdown


def _shard_backward_s(profile: Profile, whole: StageCost, workers: int, slowdown: float) -> list[float]:
    """Each layer's backward on one of ``workers`` data-parallel workers' shard of the minibatch (``whole``:
    the profile as one stage, at the minibatch), as long as it takes beside the machine's other workers
    (``slowdown``)."""
    scale = costs.contended_s(whole.share(workers).backward_s, slowdown) / \
        max(sum(x.backward_s for x in profile.layers), 1e-300)
    return [x.backward_s * scale for x in profile.layers]


@dataclass
class CGDPPrediction:
    """What :func:`predict_cgdp` predicts for CPU-GPU data parallel training at one chunk size.

    Attributes:
        samples_per_s: from the simulator over cgdp's action lists (forward, the backward T of eq. 1,
            update).
        iteration_s: forward + T + update of one worker.
        backward_s: T, eq. 1 (the backward with every chunk's sum back on the worker).
        plain_backward_s: T_BP, the backward alone.
        overhead_s: T_O = T - T_BP, what CGDP adds per iteration (exact, from eq. 1).
        overhead_eq2_s: eq. 2's closed form of T_O.
        dp_overhead_s: T'_O of data parallelism accumulating after the backward (§3.2), from the same
            host costs.
        wins: §3.2's condition for CGDP to beat data parallelism.
        chunks: per chunk in backward order: ``layers`` (profile layer indices), ``bytes``, and its
            ``bp_s``, ``as_s``, ``aa_s``, ``bc_s`` and ``done_s`` (T_BP^i).
        sim: the simulator's result.
    """

    samples_per_s: float
    iteration_s: float
    backward_s: float
    plain_backward_s: float
    overhead_s: float
    overhead_eq2_s: float
    dp_overhead_s: float
    wins: bool
    chunks: list[dict[str, object]]
    sim: SimResult = field(repr=False)

    def to_dict(self) -> dict[str, object]:
        """Every field but the simulator's result, as JSON-ready data."""
        return {k: v for k, v in vars(self).items() if k != "sim"}


def predict_cgdp(profile: Profile, workers: int, chunk: int, batch_size: int | None = None,
                 update_s: float | None = None, copy_s_per_byte: float = 0.0, sum_s_per_byte: float = 0.0,
                 signal_s: float = 0.0, copy_back_s_per_byte: float = 0.0, cores_per_worker: float | None = None,
                 minibatches: int = 16) -> CGDPPrediction:
    """Predict one CGDP iteration from a profile with the cost model of CGDP §3.2 (eq. 1-2), at chunk
    size ``chunk`` (§4's chunks, :func:`pipetrain.strategies.chunks.chunk_layout`).

    Units are the profile's layers with parameters, in backward order; a layer without parameters
    adds its backward to the next unit that has some (the chunk's gradient exists only after it).
    Per chunk: t_bp its layers' backward (each worker on its 1/``workers`` shard); t_as 0 (the hand-off
    to the summing thread is a queue put; on a GPU the paper's stream synchronisation, not modelled);
    t_aa the copy into host memory, two signals (``signal_s`` each) and the sum of its share, on the
    summing thread, queued behind the previous chunk's (one summing thread per worker); t_bc the
    copy back (0 on CPU, where ``.grad`` views the shared sum).

    Args:
        profile: per-layer costs of the whole model.
        workers: the machine's workers (L).
        chunk: layers per chunk.
        batch_size: samples per minibatch of the whole job (default: the profile's).
        update_s: seconds per optimizer step (default: the profile's optimizer seconds).
        copy_s_per_byte, sum_s_per_byte: host costs (:func:`pipetrain.strategies.cgdp.measure_host_costs`).
        signal_s: one 1-element allreduce among the machine's workers.
        copy_back_s_per_byte: host to device (GPU only).
        cores_per_worker: with fewer than 2, the host's copies, sums and signals (the set-up's
            ``allreduce_cpu_s`` each) run on the cores the backward uses, so the backward cannot end
            before its own time plus their CPU
            (:func:`pipetrain.costs.shared_core_compute_s`; ours, not the paper's). Default: the
            profile's measured set-up's, else unlimited.
        minibatches: for the simulator.

    With a measured set-up in the profile, compute takes its ``slowdown`` times as long.
    """
    from pipetrain.strategies.chunks import chunk_layout

    [whole] = stage_costs(profile, [0], batch_size)
    mine = whole.share(workers)
    slowdown = 1.0 if profile.setup is None else profile.setup.slowdown
    priced, shard_slowdown = _shard_priced(profile, whole, workers, batch_size)
    if update_s is None:
        update_s = costs.contended_s(whole.update_s, slowdown)
    if cores_per_worker is None:
        cores_per_worker = math.inf if profile.setup is None else profile.setup.cores_per_worker
    shard = _shard_backward_s(profile, whole, workers, shard_slowdown)
    units: list[tuple[list[int], float, int]] = []  # (profile layers, backward seconds, parameter bytes)
    pending: list[int] = []
    for i in reversed(range(len(profile))):
        pending.append(i)
        if profile.layers[i].parameter_bytes:
            units.append((pending, sum(shard[j] for j in pending), profile.layers[i].parameter_bytes))
            pending = []
    tail_s = sum(shard[j] for j in pending)
    rows = []
    for ids in chunk_layout(len(units), chunk):
        nbytes = sum(units[i][2] for i in ids)
        rows.append({"layers": sorted(j for i in ids for j in units[i][0]), "bytes": nbytes,
                     "bp_s": sum(units[i][1] for i in ids), "as_s": 0.0,
                     "aa_s": 2 * signal_s + nbytes * (copy_s_per_byte + sum_s_per_byte),
                     "bc_s": nbytes * copy_back_s_per_byte})
    bp, sync, aa, bc = ([float(r[k]) for r in rows] for k in ("bp_s", "as_s", "aa_s", "bc_s"))  # type: ignore[arg-type]
    for r, done in zip(rows, costs.cgdp_unit_times(bp, sync, aa, bc, serial=True)):
        r["done_s"] = done
    backward = costs.cgdp_backward_s(bp, sync, aa, bc, tail_s, serial=True) if rows else tail_s
    # the summing thread's CPU: copies, sums and each chunk's two signals (waiting in them costs CPU)
    signal_cpu = 0.0 if profile.setup is None else profile.setup.allreduce_cpu_s
    host_bytes = sum(int(r["bytes"]) for r in rows)  # type: ignore[call-overload]
    host_cpu = host_bytes * (copy_s_per_byte + sum_s_per_byte) + 2 * len(rows) * signal_cpu
    backward = max(backward, costs.shared_core_compute_s(0.0, sum(bp) + tail_s, host_cpu, cores_per_worker))
    overhead = backward - sum(bp) - tail_s
    sim = simulate(build_data_parallel("cgdp", workers, minibatches), priced, [0], Link(), batch_size,
                   update_s, sync_s=[overhead])
    batch = profile.batch_size if batch_size is None else batch_size
    iteration = costs.contended_s(mine.forward_s, shard_slowdown) + costs.contended_s(mine.batching_s, slowdown) + \
        backward + update_s
    return CGDPPrediction(
        samples_per_s=sim.samples_per_s or (batch / iteration if batch else 0.0), iteration_s=iteration,
        backward_s=backward, plain_backward_s=sum(bp) + tail_s, overhead_s=overhead,
        overhead_eq2_s=costs.cgdp_overhead_eq2(sync, aa, bc) if rows else 0.0,
        dp_overhead_s=costs.dp_overhead_s(aa, bc), wins=costs.cgdp_wins(sync, aa, bc) if rows else False,
        chunks=rows, sim=sim)
