"""Discrete-event simulator: execute a Schedule's action lists with profiled costs and a link model.

The simulator runs the very action lists the runtime runs, so its timeline has the runtime's trace
format and :mod:`pipetrain.trace` draws both. Stage costs come from :mod:`pipetrain.stagecost`; the
data-parallel and CGDP predictions built on this engine live in :mod:`pipetrain.predict`.

[Note: timing rules] Every worker runs its actions in order, with no gaps:

* ``F``/``B`` last the stage's forward/backward seconds (sum over its layers; ``I``/``W`` the backward's
  input- and weight-gradient parts, :meth:`pipetrain.stagecost.StageCost.backward_part_s`), divided by the
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
* ``U`` lasts ``update_s`` (default: the optimizer seconds the profile holds for the stage's layers;
  on a worker holding several stages, whose actions name their stage, a ``U`` steps all: their sum);
  with a tied parameter (the profile's ``ties`` across stages) a borrowing stage's ``U`` first sends
  its gradient to the owning stage, whose ``U`` waits for every such gradient and then sends each
  borrower the new value; a borrower's first forward of a minibatch waits for the value of the
  version the input stage ran it at (:mod:`pipetrain.runtime.tied`).

[Note: run set-up] A profile that carries a measured :class:`pipetrain.setup.Setup` (workers on one
machine, per-message cost) changes four rules, all through :mod:`pipetrain.costs`:

* compute (F, B, U; on ``pipedream`` and ``2bw`` the copy of a new weight version at a stage that stashes; in a
  backward after another since the stage's last update, as microbatches have, the add of its
  gradients into ``.grad`` at the set-up's ``add_s_per_byte``) takes ``slowdown`` times as long
  (:func:`~pipetrain.costs.contended_s`), or, where every worker's threads have cores of their own,
  as long as the share of the other workers computing meanwhile makes it
  (:func:`~pipetrain.costs.overlap_slowdown`, found in passes: :func:`_run`);
* a transfer takes the measured message latency more (between the idle and the busy one, by how much
  of the time its two ends compute: :func:`_run`), at the slower of the link's and the measured
  seconds per byte;
* a send and a receive take the CPU a message end costs from a worker with under 2 cores;
* a replicated stage's sync is a ring allreduce with the measured allreduce's latency per step and
  the ring's seconds per byte (the slower of it and the link's), once per bucket of its gradient
  (:func:`pipetrain.strategies.allreduce.buckets`: the runtime's replicas allreduce in buckets). Its
  ``A``, which starts the last bucket's allreduce, takes the CPU of a message end of that bucket's
  bytes, as a send does. Replicas whose compute varies (the set-up's ``jitter_s``) do not arrive
  when simulated: a sync begins when the last of them is expected
  (:func:`~pipetrain.costs.last_arrival_s`, each replica's simulated start varied by its stage's
  contended forward and backward).

Each link has a single sender, which issues transfers in program order, and every other time is a
max over already known times, so event times do not depend on the order in which workers are
advanced: the loop runs each worker until it blocks and repeats until all are done.
"""
from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

from pipetrain import costs
from pipetrain.costs import dp_sync_bytes
from pipetrain.profiling import Profile
from pipetrain.setup import Setup
from pipetrain.schedule import Schedule, validate
from pipetrain.schedule.actions import (
    BACKWARD, FORWARD, INPUT_GRAD, RECV_ACT, RECV_GRAD, SEND_ACT, SENDS, START_SYNC, SYNC, UPDATE, WEIGHT_GRAD,
    Action,
)
from pipetrain.stagecost import tied_stages, StageCost, shard_priced, stage_costs
from pipetrain.strategies.allreduce import buckets, last_bucket_bytes
from pipetrain.simresult import Link, SimResult
from pipetrain.trace import Record

BACKWARDS = (BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
COMPUTING = (FORWARD, *BACKWARDS, UPDATE)
"""The actions that hold a worker's core and interpreter."""


def link_terms(link: Link, setup: Setup | None, allreduce: Literal["ours", "backend"] | None = None,
               idle: bool = False, nbytes: float | None = None) -> tuple[float, float]:
    """(latency, seconds per byte) of one message on ``link``, or with ``allreduce`` (``"ours"``: our
    ring, ``"backend"``: the backend's ``all_reduce``) of one step of an allreduce of a gradient of
    ``nbytes``: with a measured set-up, its message (allreduce) latency more, at the slower of the
    link's and the measured transport's (allreduce's) seconds per byte (see [Note: run set-up] and
    :meth:`pipetrain.setup.Setup.allreduce_terms`); ``idle``: our ring's as measured with nothing
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
                 others: Sequence[Sequence[float]] | None = None,
                 ties: Sequence[tuple[list[int], int]] = ()) -> None:
        self.sched, self.costs, self.link, self.setup = schedule, stages, link, setup
        # tied parameters (stages reading it, bytes): the owner's and each borrower's counterparts
        rank = schedule.first_worker
        self.borrowers: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.lenders: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for tied, nbytes in ties:
            for s in tied[1:]:
                self.borrowers[rank(tied[0])].append((rank(s), nbytes))
                self.lenders[rank(s)].append((rank(tied[0]), nbytes))
        self.input_version: dict[int, int] = {}  # minibatch -> the input stage's version at its forward
        self.tied_version = [0] * schedule.num_workers  # the newest tied values a borrower has
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
        # (dst, its receive action), or (dst, "TG"|"TV", update, peer) of a tie -> (arrival, bytes)
        self.arrival: dict[tuple[int, Action] | tuple[int, str, int, int], tuple[float, float]] = {}
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
        self.latency_s, self.byte_s = link_terms(link, setup)
        self.sync_s = list(sync_s) if sync_s is not None else [
            0.0 if r == 1 else link.transfer_s(dp_sync_bytes(c.parameter_bytes, r)) if setup is None else
            costs.ring_allreduce_time(r, c.parameter_bytes,
                                      *link_terms(link, setup, allreduce="backend", nbytes=c.parameter_bytes), 0.0,
                                      segments=buckets(c.parameter_bytes))
            for c, r in zip(stages, schedule.replicas)]
        self.start_sync_s = [0.0 if r == 1 else self._cpu_s(last_bucket_bytes(c.parameter_bytes))
                             for c, r in zip(stages, schedule.replicas)]
        self.jitter_s = 0.0 if setup is None else setup.jitter_s
        self.work_s = [costs.contended_s(c.forward_s + c.backward_s, self.slowdown) for c in stages]
        # pipedream's output stage never holds two minibatches, so it runs without stashed copies; 2bw's does
        self.copy_s = [c.parameter_bytes * setup.copy_s_per_byte if self.stashes and setup is not None and
                       (s < len(stages) - 1 or schedule.double_buffered) else 0.0 for s, c in enumerate(stages)]
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
        s, m = self.sched.stage_at(w, a), self.sched.microbatches
        if a.kind == FORWARD:
            first = a.micro in (None, 0)  # builds the minibatch; may make a new weight version
            if s == 0 and first:
                self.input_version[a.mb] = self.updates[w] * self.sched.replicas[0]
            if first and w in self.lenders:  # a borrower first gets the tied values this minibatch reads
                want = self.input_version[a.mb]
                if want > self.tied_version[w]:
                    values = [self.arrival.get((w, "TV", want, owner)) for owner, _ in self.lenders[w]]
                    if any(v is None for v in values):
                        return None
                    start = max(start, *(v[0] for v in values if v is not None)) + \
                        sum(self._cpu_s(n) for _, n in self.lenders[w])
                    self.tied_version[w] = want
            copy = self.copy_s[s] if first and self.updates[w] not in self.versions[w].values() else 0.0
            build = self.costs[s].batching_s if first else 0.0
            return start + self._compute_s(w, self.costs[s].forward_s / m + copy + build)
        if a.kind in BACKWARDS:  # an input-gradient backward adds nothing into .grad
            add = self.add_s[s] if self.grads_held[w] and a.kind != INPUT_GRAD else 0.0
            return start + self._compute_s(w, self.costs[s].backward_part_s(a.kind) / m + add)
        if a.kind in SENDS:
            dst = self.sched.peer(w, a)
            assert dst is not None
            cut = s if a.kind == SEND_ACT else s - 1  # gradients cross the cut after the previous stage
            nbytes = self.costs[cut].output_bytes / m
            self.arrival[(dst, a.counterpart())] = (self._send(w, dst, nbytes, start), nbytes)
            return start + self._cpu_s(nbytes)
        if a.kind in (RECV_ACT, RECV_GRAD):
            got = self.arrival.pop((w, a), None)
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
        return self._update_end(w, self.sched.stages_of(w) if a.stage is None else (s,), start)

    def _update_end(self, w: int, stages: tuple[int, ...], start: float) -> float | None:
        """An update, with the tied parameters' exchange: a borrower sends its gradient to the owner; the
        owner waits for every borrower's, steps, and sends each the new values."""
        k = self.updates[w]
        if w in self.borrowers:
            grads = [self.arrival.get((w, "TG", k, b)) for b, _ in self.borrowers[w]]
            if any(g is None for g in grads):
                return None
            start = max(start, *(g[0] for g in grads if g is not None)) + \
                sum(self._cpu_s(n) for _, n in self.borrowers[w])
        for owner, nbytes in self.lenders.get(w, []):
            self.arrival[(owner, "TG", k, w)] = (self._send(w, owner, nbytes, start), nbytes)
            start += self._cpu_s(nbytes)
        end = start + sum(self._compute_s(w, self.costs[s].update_s) if self.update_s is None else self.update_s[s]
                          for s in stages)
        for b, nbytes in self.borrowers.get(w, []):
            self.arrival[(b, "TV", k + 1, w)] = (self._send(w, b, nbytes, end), nbytes)
            end += self._cpu_s(nbytes)
        return end

    def _send(self, src: int, dst: int, nbytes: float, start: float) -> float:
        """Put a message on the link ``src`` -> ``dst`` at ``start``; when it arrives."""
        begin = max(start, self.link_free[(src, dst)])
        self.link_free[(src, dst)] = begin + self._transfer_s(nbytes, src, dst)
        return self.link_free[(src, dst)]

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
        if a.kind in (FORWARD, *BACKWARDS):
            self.busy_s[w] += seconds
        if a.kind in COMPUTING:
            self.compute_s[w] += seconds
        if a.kind in (BACKWARD, WEIGHT_GRAD):
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
            if self.sched.double_buffered:  # the new live version beside the one in flight
                self._count_versions(w)
        elif a.kind == FORWARD:
            self.in_flight[w] += 1
            self.peak_in_flight[w] = max(self.peak_in_flight[w], self.in_flight[w])
            if a.micro in (None, 0):
                if self.sched.double_buffered:  # 2bw: round q of the worker's minibatches at max(0, q-1) updates
                    self.versions[w][a.mb] = max(0, a.mb // self.sched.replicas[self.sched.stage_of(w)] - 1)
                else:
                    self.versions[w][a.mb] = self.updates[w]
                if self.stashes:  # only a stashing schedule holds a version per minibatch
                    self._count_versions(w)
        elif a.kind in (BACKWARD, WEIGHT_GRAD):  # a split backward holds the activations until its W
            self.in_flight[w] -= 1
            if a.micro in (None, self.sched.microbatches - 1):
                self.versions[w].pop(a.mb, None)  # a worker holding several stages: at the first


    def _count_versions(self, w: int) -> None:
        """The distinct versions ``w`` holds for its minibatches in flight (2bw: and the live one)."""
        held = {*self.versions[w].values(), *([self.updates[w]] if self.sched.double_buffered else [])}
        self.peak_versions[w] = max(self.peak_versions[w], len(held))


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
            (see :func:`pipetrain.stagecost.stage_costs`); a sharded schedule's workers each take 1/r of it.
        update_s: seconds per optimizer step of every stage, as given (default: each stage's from the
            profile, contended as [Note: run set-up] says).
        sync_s: seconds one gradient sync of each stage takes (default: PipeDream's W^m, see
            [Note: timing rules]).

    The profile's measured set-up, if it has one, changes the rules as [Note: run set-up] says. A
    schedule of one stage that is not sharded (each replica trains on whole minibatches), and every
    stage of a schedule that runs microbatches, take their forward's and backward's slowdown from the
    set-up's training step when that step was of a microbatch's rows (a whole minibatch without
    microbatches): the whole model's step over its layers' sum
    (:func:`~pipetrain.stagecost.shard_priced`, one share per microbatch); their updates keep the
    set-up's own slowdown. For one stage the step is exactly what each replica runs, timed in the
    workers all at once; for small microbatches a layer profile summed under-reads what a microbatch
    costs (``python benchmarks/sim_vs_real.py`` measures the simulator against real runs).

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
        # microbatch's rows; the update keeps the set-up's slowdown, as in the data-parallel predictions
        if update_s is None:
            updates = [costs.contended_s(c.update_s, profile.setup.slowdown) for c in per_stage]
        profile = shard_priced(profile, stage_costs(profile, [0], batch_size)[0], schedule.microbatches,
                                batch_size)[0]
        per_stage = stage_costs(profile, boundaries, batch_size)  # its building keeps the set-up's slowdown
    sim = _run(schedule, per_stage, link, updates, sync_s, profile.setup, contention, tied_stages(profile, boundaries))
    makespan = max(sim.clock, default=0.0)
    busy = [b / makespan if makespan > 0 else 0.0 for b in sim.busy_s]
    scale = [c.stash_bytes / schedule.microbatches for c in sim.costs]
    rate = _minibatches_per_s(schedule, sim.update_end, sim.last_backward, makespan)
    return SimResult(
        minibatches_per_s=rate, samples_per_s=rate * batch if batch > 0 else None,
        makespan_s=makespan, busy_fraction=busy, bubble_fraction=1.0 - sum(busy) / len(busy),
        peak_weight_versions=sim.peak_versions,
        peak_activation_bytes=[p * max(scale[s] for s in schedule.stages_of(w))
                               for w, p in enumerate(sim.peak_in_flight)],
        trace=sim.trace)


SHARE_PASSES = 8
"""At most this many passes find the workers' compute shares a message's latency follows (:func:`_run`)."""


def _run(schedule: Schedule, stages: list[StageCost], link: Link, update_s: Sequence[float] | None,
         sync_s: Sequence[float] | None, setup: Setup | None, contention: float,
         ties: Sequence[tuple[list[int], int]] = ()) -> _Sim:
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
    sim = _Sim(schedule, stages, link, update_s, sync_s, setup, contention, ties=ties)
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
        sim = _Sim(schedule, stages, link, update_s, sync_s, setup, contention, shares, others, ties)
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
    if not schedule.sharded and schedule.replicas[last] > 1:  # a window's partial last round updates unsynced
        steps = steps[:sum(a.kind == SYNC for a in schedule.actions[w])]
    if len(steps) >= 2 and steps[-1] > steps[0]:
        # one step of a replicated stage applies the minibatches of all its replicas (of a sharded
        # stage, one minibatch split over them)
        per_step = 1 if schedule.sharded else schedule.replicas[last]
        return (len(steps) - 1) * per_step / (steps[-1] - steps[0])
    minibatches = len({a.mb for acts in schedule.actions for a in acts})
    return minibatches / makespan if makespan > 0 else math.inf


