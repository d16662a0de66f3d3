"""PipeDream's partitioner (arXiv:1806.03377, §3.2): a profile in, stages and replicas out.

The recurrence is the paper's: with T(i -> j, m) the time of one stage of layers i..j on m replicas
and C_i the time to send the cut after layer i,

    A(j, m) = min( T(1 -> j, m),
                   min over i < j, 1 <= m' < m of max(A(i, m - m'), 2 C_i, T(i+1 -> j, m')) )

and the answer is A(N, M). The formulas for T and C live in :mod:`pipetrain.costs`.

[Note: suffix table] The table is filled from the output end: ``S[i, m]`` is the best slowest-stage
time for layers i..N-1 on m workers, and each step puts one more stage in front of an optimal suffix.
It is the same recurrence read backwards. It is done this way because the memory limit needs a
stage's in-flight count, ceil(workers from the stage to the output / its replicas), and a suffix
knows that number when the stage is placed, however many workers the whole plan ends up with.

[Note: placement] Workers are numbered from the output end and each stage takes the next
consecutive numbers, so under a two-level topology (K workers per server) whether a stage fits in one
server follows from its numbers. A stage syncs weights at the intra-server bandwidth when all its
replicas share a server, else at the inter-server one; a boundary uses the intra-server bandwidth when
both stages beside it lie in one server. To price boundaries exactly, the table has a flag: whether
the suffix's first stage lies in one server. When M is a multiple of K this is the same packing as
ranks counted from the input stage; otherwise the partly filled server sits at the input end.
PipeDream's released optimizer handles two levels differently (it first pipelines within a server,
then pipelines servers); this is exact for packed placement instead.

[Note: solve time] Each step is vectorized over workers, replicas, next layer and flag, so the
O(N^2 M^2) table stays cheap: 200 layers x 64 workers with replication solve in about 0.1 s on 2 CPU
cores (``pytest -s tests/test_planner.py::test_large_solve_is_fast`` prints it). A memory limit and a
two-level topology, which doubles the table and prices every boundary, take a few times as long.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipetrain.costs import (
    SYNC_ALGORITHMS, allreduce_copy_bytes, boundary_time, dp_sync_bytes, stage_memory_bytes, stage_time, stage_work_s,
    straggler_s, worker_memory_bytes,
)
from pipetrain.planning.result import Plan, StagePlan
from pipetrain.planning.units import format_bytes, parse_bandwidth, parse_bytes
from pipetrain.profiling import Profile
from pipetrain.setup import Setup
from pipetrain.schedule.generators import noam
from pipetrain.schedule.kinds import PipeDream, PipelineSchedule

INF = float("inf")

CUT_BUDGET = 40 * 1024
"""Stage boundaries the dynamic program weighs, times the workers: its work grows with the square of
each, so a profile of more layers than ``CUT_BUDGET // workers`` (at least :data:`MIN_CUTS`) is cut only
at that many boundaries (:func:`cut_positions`). vgg16's 40 layers on 1024 workers take about 8 s."""
MIN_CUTS = 40


@dataclass(frozen=True)
class Topology:
    """Workers packed ``workers_per_server`` to a server; bandwidths in bytes per second.

    A flat cluster is one server as large as the job with both bandwidths equal.
    """

    workers_per_server: int
    intra_bandwidth: float
    inter_bandwidth: float

    def __post_init__(self) -> None:
        if self.workers_per_server < 1:
            raise ValueError(f"workers per server must be >= 1, got {self.workers_per_server}")
        if self.intra_bandwidth <= 0 or self.inter_bandwidth <= 0:
            raise ValueError("bandwidths must be positive")

    def server(self, position: np.ndarray) -> np.ndarray:
        return position // self.workers_per_server


@dataclass(frozen=True)
class _Terms:
    """What a profile's measured set-up adds to the paper's T and C (nothing without one): compute
    ``slowdown``, a message's ``latency``, the ``jitter`` of compute, and the measured allreduce's
    latency per step and bytes per second."""

    slowdown: float = 1.0
    latency: float = 0.0
    jitter: float = 0.0
    ring_latency: float = 0.0
    ring_rate: float = INF

    @staticmethod
    def of(setup: Setup | None) -> _Terms:
        if setup is None:
            return _Terms()
        ring_latency, ring_per_byte = setup.allreduce_terms(ours=False)
        return _Terms(setup.slowdown, setup.latency_s, setup.jitter_s, ring_latency,
                      INF if ring_per_byte == 0 else 1 / ring_per_byte)

    def stage_s(self, work: Any, params: Any, replicas: Any, bandwidth: Any, allreduce: str,
                overlap: bool = True) -> Any:
        """T of a stage whose ``replicas`` each do ``work`` seconds per minibatch and sync ``params``
        bytes of weights: the measured allreduce's latencies and the slower of the link and the measured
        ring per byte; and the replicas wait for the slowest of them at every sync, which no sync overlaps."""
        sync = dp_sync_bytes(params, replicas, allreduce) / np.minimum(bandwidth, self.ring_rate) \
            + 2 * (replicas - 1) * self.ring_latency
        return stage_time(work + straggler_s(work, self.jitter, replicas), sync, replicas, overlap)


@dataclass(frozen=True)
class _Sums:
    """A profile's running sums (index j: layers before j) and per-cut costs, from which the dynamic
    program and :func:`price_stages` price a stage of layers i..j-1 and the boundary before layer j.

    [Note: run set-up] of the simulator, in the planner's terms: a stage pays the CPU of the two
    message ends at each of its cuts (activations and gradients), a stashed copy of its weights (not
    the output stage), its compute slowed by workers sharing cores; a boundary pays the message
    latency and the slower of the link and the transport; a replicated stage its sync and its wait for
    the slowest replica (:meth:`_Terms.stage_s`)."""

    n: int
    compute: np.ndarray
    params: np.ndarray
    grads: np.ndarray
    states: np.ndarray
    acts: np.ndarray
    cut: np.ndarray  # bytes crossing the boundary before layer j; nothing crosses after the last layer
    cpu: np.ndarray  # the CPU of a cut's two message ends
    copy_per_byte: float
    transport: float  # the measured transport's bytes per second
    terms: _Terms

    @staticmethod
    def of(profile: Profile) -> _Sums:
        layers, setup, n = profile.layers, profile.setup, len(profile)

        def running(values: list[float]) -> np.ndarray:
            return np.concatenate([np.zeros(1), np.cumsum(values)])
        cut = np.array([float(profile.input_bytes)] + [float(x.activation_bytes) for x in layers[:-1]] + [0.0])
        return _Sums(n, running(list(profile.work_s())), running([float(x.parameter_bytes) for x in layers]),
                     running([float(x.gradient_bytes) for x in layers]),
                     running([float(x.optimizer_bytes) for x in layers]),
                     running([float(x.activation_bytes) for x in layers]), cut,
                     np.array([0.0] + [2 * setup.shared_cpu(c) if setup else 0.0 for c in cut[1:n]] + [0.0]),
                     0.0 if setup is None else setup.copy_s_per_byte,
                     INF if setup is None or setup.s_per_byte == 0 else 1 / setup.s_per_byte, _Terms.of(setup))

    def stage_s(self, i: int, js: np.ndarray, r: Any, bandwidth: Any, allreduce: str, overlap: bool) -> Any:
        """T of layers i..j-1 (each j of ``js``) on ``r`` replicas syncing at ``bandwidth``."""
        part = self.params[js] - self.params[i]
        work = stage_work_s(self.compute[js] - self.compute[i], 0.0,
                            np.where(js < self.n, part * self.copy_per_byte, 0.0), self.cpu[i] + self.cpu[js],
                            self.terms.slowdown)
        return self.terms.stage_s(work, part, r, bandwidth, allreduce, overlap)

    def boundary_s(self, js: np.ndarray, bandwidth: Any) -> Any:
        """2 C of the cut before each layer j of ``js`` at ``bandwidth``; 0 after the last layer."""
        return np.where(js < self.n, boundary_time(self.cut[js], np.minimum(bandwidth, self.transport),
                                                   self.terms.latency), 0.0)


@dataclass
class _Table:
    """The solved table: best time, and the choice that reached it, per (first layer, workers, flag)."""

    best: np.ndarray  # (N + 1, M + 1, F): first layer, workers, flag
    next_layer: np.ndarray  # first layer of the rest of the pipeline
    replicas: np.ndarray  # replicas of the stage placed in front
    next_flag: np.ndarray  # the flag of the rest
    stage_s: np.ndarray  # T of the stage placed in front
    boundary_s: np.ndarray  # 2 C of the cut after it


def plan(profile: Profile | str | os.PathLike, workers: int, bandwidth: float | str = "10Gbit", *,
         straight: bool = False, memory: float | str | None = None, workers_per_server: int | None = None,
         intra_bandwidth: float | str | None = None, fewer_workers: bool = False, allreduce: str = "ps",
         source: str | None = None, one_stage: bool = False, recompute: bool = False,
         schedule: PipelineSchedule | None = None, also: Sequence[int] = (), sync_overlaps: bool = True) -> Plan:
    """Partition a profiled model over ``workers`` with PipeDream's dynamic program (§3.2).

    Args:
        profile: a :class:`Profile`, or the path of one (our JSON or a PipeDream graph.txt).
        workers: M, the workers to use (all of them unless ``fewer_workers``).
        bandwidth: between workers (between servers with ``workers_per_server``); bytes/s or a
            string such as ``10Gbit`` or ``1.25GB/s``.
        straight: one worker per stage (no replication).
        memory: bytes per worker (or ``16GiB``); configurations whose worker would not hold its
            stage's weights, stashed weight versions, stashed activations, gradients, optimizer state
            and a replicated stage's allreduce copies beside the profile's ``baseline_bytes`` are
            excluded (:func:`pipetrain.costs.worker_memory_bytes`, as :mod:`pipetrain.predict.memory`
            predicts a worker's peak).
        recompute: the memory limit counts activation recomputation (``train(recompute=True)``):
            in-flight (micro)batches keep their inputs only, plus one's activations while it reruns.
        schedule: whose in-flight counts and weight versions the memory limit counts
            (:meth:`PipelineSchedule.in_flight`, :meth:`PipelineSchedule.weight_versions`; default
            pipedream's).
        workers_per_server: K; with ``intra_bandwidth``, a two-level topology (see [Note: placement]).
        intra_bandwidth: between workers of one server.
        fewer_workers: use fewer than ``workers`` when more would not be faster.
        allreduce: weight sync volume, ``ps`` (parameter server, the paper's) or ``ring``.
        source: names the profile in error messages (default: its path, or ``profile``).
        one_stage: not the partitioner's choice but every layer as one stage on all ``workers``, priced as
            it prices a stage: data parallelism through the pipeline runtime, for comparing with its choice.
        also: worker counts below ``workers`` whose best plans (all of each count's workers) come in the
            result's :attr:`Plan.alternatives`, read from the same table: the suffix table holds every
            count's optimum, so candidates for fewer workers cost no second solve (counts nothing fits
            are left out); and, where ``also`` names any, for ``workers`` and each of them the fewest
            workers whose plan the partitioner finds as fast.
        sync_overlaps: a replicated stage's sync hides behind its compute, as §3.2's T assumes; False
            adds it (:func:`pipetrain.costs.stage_time`), as pipetrain's ``pipedream`` schedule runs it.

    Returns:
        The plan with the least predicted slowest-stage time (with ``one_stage``, that one stage).

    Raises:
        ValueError: bad arguments or profile, or no configuration that meets the constraints
            (one line saying which and what to do).
    """
    if not isinstance(profile, Profile):
        source = source or str(profile)
        profile = Profile.load(profile)
    source = source or "profile"
    _check_profile(profile, source)
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if (workers_per_server is None) != (intra_bandwidth is None):
        raise ValueError("a two-level topology needs both workers_per_server and intra_bandwidth")
    inter = parse_bandwidth(bandwidth)
    topo = (Topology(workers, inter, inter) if workers_per_server is None else Topology(
        workers_per_server, parse_bandwidth(intra_bandwidth, "intra_bandwidth"), inter))  # type: ignore[arg-type]
    limit = None if memory is None else parse_bytes(memory, "memory")
    if allreduce not in SYNC_ALGORITHMS:
        raise ValueError(f"unknown sync algorithm {allreduce!r}; use one of {', '.join(SYNC_ALGORITHMS)}")
    if not isinstance(recompute, bool):
        raise ValueError(f"recompute={recompute!r} must be True or False")
    memory_model = _MemoryModel(schedule or PipeDream(), recompute, limit) if limit is not None else None

    workers = int(workers)
    options: dict[str, Any] = {"workers": workers, "bandwidth": inter, "straight": straight, "memory": limit,
                               "workers_per_server": workers_per_server,
                               "intra_bandwidth": None if intra_bandwidth is None else topo.intra_bandwidth,
                               "fewer_workers": fewer_workers, "allreduce": allreduce, "profile": source,
                               "model": profile.model, "batch_size": profile.batch_size, "recompute": recompute,
                               "sync_overlaps": sync_overlaps}
    if one_stage:
        return _result(profile, [_one_stage(profile, workers, topo, allreduce)], workers, topo, allreduce, options)
    positions = cut_positions(profile, max(MIN_CUTS, CUT_BUDGET // workers))
    if len(positions) < len(profile) + 1:
        options["boundaries_weighed"] = len(positions) - 2
    table = _solve(profile, workers, topo, straight, memory_model, allreduce, sync_overlaps, positions)
    used, flag = _pick(table, workers, fewer_workers)
    if table.best[0, used, flag] == INF:
        raise ValueError(_infeasible(profile, workers, straight and not fewer_workers, limit, source))
    chosen = _result(profile, _stages(table, len(profile), used, flag), workers, topo, allreduce, options)
    if also:  # and each count's fewest workers as fast in the partitioner's model: ties the simulator may break
        also = [_pick(table, c, True)[0] for c in {workers, *(c for c in also if 1 <= c < workers)}] + list(also)
    for count in sorted({int(c) for c in also if 1 <= c < workers}, reverse=True):
        c, f = _pick(table, count, False)
        if table.best[0, c, f] < INF:
            chosen.alternatives.append(_result(profile, _stages(table, len(profile), c, f), count, topo, allreduce,
                                               {**options, "workers": count}))
    return chosen


def price_stages(profile: Profile, boundaries: Sequence[int], replicas: Sequence[int],
                 bandwidth: float | str = "10Gbit", *, allreduce: str = "ps", sync_overlaps: bool = True) -> Plan:
    """A plan given by hand (each stage's first layer and replicas), priced by the partitioner's model
    (PipeDream §3.2, :func:`plan`'s T and 2 C on a flat cluster at ``bandwidth``): what the dynamic
    program would predict for it, to set beside the simulator and a real run of the same plan.

    Raises:
        ValueError: stages that do not start at layer 0 and rise within the profile, or replicas not
            one positive count per stage (or a tied layer in a replicated stage).
    """
    n, bw = len(profile), parse_bandwidth(bandwidth)
    firsts, counts = [int(b) for b in boundaries], [int(r) for r in replicas]
    if not firsts or firsts[0] != 0 or any(b <= a for a, b in zip(firsts, firsts[1:])) or firsts[-1] >= n:
        raise ValueError(f"stages {firsts}: give each stage's first layer, from 0 and rising, below {n}")
    if len(counts) != len(firsts) or min(counts) < 1:
        raise ValueError(f"replicas {counts}: give one count of at least 1 per stage ({len(firsts)})")
    sums, ties = _Sums.of(profile), [(np.array(layers), float(nbytes)) for layers, nbytes in profile.ties]
    stages = []
    for i, j, r in zip(firsts, [*firsts[1:], n], counts):
        js = np.array([j])
        T = _with_ties(sums.stage_s(i, js, r, bw, allreduce, sync_overlaps), ties, i, js, np.array(r),
                       min(bw, sums.transport))
        stages.append(StagePlan(i, j - 1, r, float(T[0]), float(sums.boundary_s(js, bw)[0])))
    if math.isinf(max(s.time_s for s in stages)):
        raise ValueError(f"replicas {counts}: a layer tied to another stage cannot be replicated")
    workers = sum(counts)
    return _result(profile, stages, workers, Topology(workers, bw, bw), allreduce,
                   {"workers": workers, "bandwidth": bw, "allreduce": allreduce, "sync_overlaps": sync_overlaps,
                    "model": profile.model, "batch_size": profile.batch_size})


def _result(profile: Profile, stages: list[StagePlan], workers: int, topo: Topology, allreduce: str,
            options: dict[str, Any]) -> Plan:
    """The Plan of ``stages``: its period is the slowest stage's or boundary's time."""
    period = max(max(s.time_s, s.boundary_s) for s in stages)
    one = sum(layer.compute_s for layer in profile.layers)
    return Plan(stages, noam([s.replicas for s in stages]), period, one / period,
                _data_parallel_time(profile, workers, topo, allreduce) / period, options)


def _one_stage(profile: Profile, workers: int, topo: Topology, allreduce: str) -> StagePlan:
    """Every layer as one stage on all ``workers``: data parallelism through the pipeline runtime, priced
    as :func:`_solve` prices a stage (memory not checked)."""
    terms = _Terms.of(profile.setup)
    bw = topo.intra_bandwidth if workers <= topo.workers_per_server else topo.inter_bandwidth
    work = stage_work_s(sum(profile.work_s()), 0.0, 0.0, 0.0, terms.slowdown)
    params = float(profile.parameter_bytes)
    return StagePlan(0, len(profile) - 1, workers, float(terms.stage_s(work, params, workers, bw, allreduce)), 0.0)


def _check_profile(profile: Profile, source: str) -> None:
    if not profile.layers:
        raise ValueError(f"{source}: the profile has no layers; re-run `pipetrain profile`")
    for k, layer in enumerate(profile.layers):
        values = (layer.forward_s, layer.backward_s, layer.activation_bytes, layer.parameter_bytes)
        if not all(np.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"{source}: layer {k} ({layer.name}) has a negative or non-finite time or size; "
                             "re-run `pipetrain profile`")
    if sum(layer.compute_s for layer in profile.layers) <= 0:
        raise ValueError(f"{source}: every layer takes 0 s, so there is nothing to balance; re-run `pipetrain profile`")


@dataclass(frozen=True)
class _MemoryModel:
    """What a stage must hold under ``limit``: ``schedule``'s in-flight (micro)batches and weight
    versions, with or without ``recompute``."""

    schedule: PipelineSchedule
    recompute: bool
    limit: float

    def counts(self, r: np.ndarray, workers_to_output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """In-flight (micro)batches and weight versions of a stage on ``r`` replicas with ``workers_to_output``."""
        return (np.vectorize(self.schedule.in_flight)(r, workers_to_output),
                np.vectorize(self.schedule.weight_versions)(r, workers_to_output))

    def fits(self, params: np.ndarray, grads: np.ndarray, states: np.ndarray, inputs: float, stash: np.ndarray,
             replicas: np.ndarray, counts: tuple[np.ndarray, np.ndarray], baseline: float) -> np.ndarray:
        """Whether a stage of ``params`` bytes (``grads`` of gradients, ``states`` of optimizer state), a
        minibatch's ``inputs`` and ``stash`` (its input and every layer's output), on ``replicas`` holding
        ``counts``, fits beside a process's ``baseline``, over those arrays' shapes: as
        :func:`pipetrain.predict.memory.held_bytes` counts it."""
        m = self.schedule.microbatches
        kept = stage_memory_bytes(params, stash / m, counts[0], inputs / m, self.recompute, counts[1])
        need = worker_memory_bytes(kept, grads, states, allreduce_copy_bytes(grads, replicas), baseline)
        return need <= self.limit


def cut_positions(profile: Profile, keep: int) -> np.ndarray:
    """The layer positions a stage may start at (0 and ``len(profile)`` included): every one for a profile
    of at most ``keep`` layers; else ``keep - 1`` boundaries, one per equal share of the model's compute
    (so that the stages can still balance), each where the fewest bytes cross within its share."""
    N = len(profile)
    if N <= keep:
        return np.arange(N + 1)
    work = np.cumsum(profile.work_s())
    share = work[:-1] / work[-1] if work[-1] > 0 else np.arange(1, N) / N  # before boundary j = 1 .. N-1
    bins = np.minimum((share * (keep - 1)).astype(int), keep - 2)
    crossing = np.array([float(x.activation_bytes) for x in profile.layers[:-1]])
    order = np.lexsort((crossing, bins))  # by share, then fewest bytes first
    first = order[np.r_[True, bins[order][1:] != bins[order][:-1]]]
    return np.concatenate([[0], np.sort(first) + 1, [N]])


def _solve(profile: Profile, M: int, topo: Topology, straight: bool, memory: _MemoryModel | None,
           allreduce: str, overlap: bool = True, positions: np.ndarray | None = None) -> _Table:
    """Fill the suffix table (see [Note: suffix table]) one first layer i of ``positions`` (default
    every layer) at a time, vectorized over (workers m, replicas r of the stage put in front, next
    position j, flag f), in that axis order."""
    N = len(profile)
    positions = np.arange(N + 1) if positions is None else positions
    sums = _Sums.of(profile)
    grads, states, acts, cut = sums.grads, sums.states, sums.acts, sums.cut
    transport = sums.transport

    two_level = topo.workers_per_server < M
    F = 2 if two_level else 1  # flag 0: the suffix's first stage lies in one server; 1: it spans servers
    R = 1 if straight else M
    m = np.arange(1, M + 1)[:, None, None]
    r = np.arange(1, R + 1)[None, :, None]
    start = m - r  # the stage's first worker number (see [Note: placement])
    one_server = topo.server(start) == topo.server(m - 1)
    new_flag = np.where(one_server[..., 0], 0, 1)
    # One server holds every worker unless two_level; scalars then keep the tables below free of an m axis.
    bw_stage: float | np.ndarray = topo.intra_bandwidth
    bw_boundary: float | np.ndarray = topo.intra_bandwidth
    if two_level:
        bw_stage = np.where(one_server, topo.intra_bandwidth, topo.inter_bandwidth)
        joined = (np.arange(F) == 0) & (one_server & (topo.server(start - 1) == topo.server(start)))[..., None]
        bw_boundary = np.where(joined, topo.intra_bandwidth, topo.inter_bandwidth)
    if memory is not None:
        held = memory.counts(r, np.maximum(m, r))
    # a parameter layers of several stages read (a tie): its stages exchange its gradient and value
    # every update over a link of their own (runtime.tied); it cannot be replicated
    ties = [(np.array(layers), float(nbytes)) for layers, nbytes in profile.ties]
    tie_bandwidth = min(topo.inter_bandwidth, transport)

    shape = (N + 1, M + 1, F)
    t = _Table(np.full(shape, INF), np.zeros(shape, int), np.zeros(shape, int), np.zeros(shape, int),
               np.zeros(shape), np.zeros(shape))
    t.best[N, 0, :] = 0.0  # no layers on no workers
    # padded[j, M + c] = best[j, c], inf to the left; its sliding windows give best[j, m - r] for
    # every (m, r) as a strided view, m - r < 0 landing on the padding: no gather, no copy.
    padded = np.full((N + 1, 2 * M + 1, F), INF)
    padded[N, M:] = t.best[N]
    windows = np.lib.stride_tricks.sliding_window_view(padded, M, axis=1)[:, 1:M + 1, :, ::-1][..., :R]
    rows = np.arange(M)
    for k in range(len(positions) - 2, -1, -1):
        i, after = int(positions[k]), positions[k + 1:]
        js = after[None, None, :]
        T = sums.stage_s(i, js, r, bw_stage, allreduce, overlap)
        if ties:
            T = _with_ties(T, ties, i, js, r, tie_bandwidth)
        if memory is not None:
            part = sums.params[js] - sums.params[i]
            stash = cut[i] + acts[js] - acts[i]  # the stage's input and every layer's output
            T = np.where(memory.fits(part, grads[js] - grads[i], states[js] - states[i], float(cut[i]), stash, r,
                                     held, float(profile.baseline_bytes)), T, INF)
        # nothing crosses after the last layer: no boundary, and no message latency, behind the output stage
        B = sums.boundary_s(js[..., None], bw_boundary)
        X = np.maximum(B, T[..., None])
        J = len(after)
        cand: np.ndarray = np.empty((M, R, J, F))
        np.maximum((windows[i + 1:] if J == N - i else windows[after]).transpose(1, 3, 0, 2), X, out=cand)
        cand = cand.reshape(M, R, J * F)
        jf = cand.argmin(axis=2)  # best next layer and flag for each (m, r)
        per_r = np.take_along_axis(cand, jf[..., None], axis=2)[..., 0]
        for g in range(F):
            choice = np.where(new_flag == g, per_r, INF)
            rr = choice.argmin(axis=1)
            jj, ff = np.divmod(jf[rows, rr], F)
            t.best[i, 1:, g] = choice[rows, rr]
            t.next_layer[i, 1:, g] = after[jj]
            t.replicas[i, 1:, g] = rr + 1
            t.next_flag[i, 1:, g] = ff
            t.stage_s[i, 1:, g] = np.broadcast_to(T, (M, R, J))[rows, rr, jj]
            t.boundary_s[i, 1:, g] = np.broadcast_to(B, (M, R, J, F))[rows, rr, jj, ff]
        padded[i, M:] = t.best[i]
    return t


def _with_ties(T: np.ndarray, ties: list[tuple[np.ndarray, float]], i: int, js: np.ndarray, r: np.ndarray,
               bandwidth: float) -> np.ndarray:
    """Stage times ``T`` of layers i..j-1 (for each j of ``js``) on ``r`` replicas, with the ties it shares
    with other stages: at least the time their bytes take on a link, and never replicated."""
    shared = np.zeros(js.shape)
    for layers, nbytes in ties:
        inside = ((layers >= i) & (layers < js[..., None])).sum(axis=-1)
        shared += np.where((inside > 0) & (inside < len(layers)), nbytes, 0.0)
    return np.where((shared > 0) & (r > 1), INF, np.maximum(T, shared / bandwidth))


def _pick(t: _Table, M: int, fewer_workers: bool) -> tuple[int, int]:
    """(workers, flag) of the answer: all M workers, or with ``fewer_workers`` the fewest workers
    whose time is within a relative 1e-9 of the best (rounding must not buy an idle worker)."""
    counts = range(1, M + 1) if fewer_workers else [M]
    best = min(t.best[0, c].min() for c in counts)
    c = next(c for c in counts if t.best[0, c].min() <= best * (1 + 1e-9))  # all inf: the caller says why
    return c, int(t.best[0, c].argmin())


def _stages(t: _Table, N: int, m: int, flag: int) -> list[StagePlan]:
    stages, i = [], 0
    while i < N:
        j, r = int(t.next_layer[i, m, flag]), int(t.replicas[i, m, flag])
        stages.append(StagePlan(i, j - 1, r, float(t.stage_s[i, m, flag]), float(t.boundary_s[i, m, flag])))
        i, m, flag = j, m - r, int(t.next_flag[i, m, flag])
    return stages


def _data_parallel_time(profile: Profile, M: int, topo: Topology, allreduce: str) -> float:
    """T(1 -> N, M): the whole model as one stage on all M workers (memory not checked)."""
    bw = topo.intra_bandwidth if M <= topo.workers_per_server else topo.inter_bandwidth
    params = float(profile.parameter_bytes)
    compute = sum(x.compute_s for x in profile.layers)
    return float(stage_time(compute, dp_sync_bytes(params, M, allreduce) / bw, M))


def _infeasible(profile: Profile, M: int, straight_all: bool, limit: float | None, source: str) -> str:
    N = len(profile)
    if straight_all and M > N:
        return (f"{source}: a straight pipeline of {N} layers uses at most {N} workers, not {M}; "
                f"ask for at most {N} workers, allow replication, or allow fewer workers")
    mem = f" within {format_bytes(limit)} per worker" if limit is not None else ""
    return (f"{source}: no configuration of {N} layers on {M} workers fits{mem}; "
            "raise the memory limit, add workers, or allow fewer workers" +
            (", or recompute activations (recompute=True)" if limit is not None else ""))
