"""Every cost formula taken from the papers, in one place.

Each function names its paper, section and equation, and says where the code departs from it. The
functions use only arithmetic and ``numpy.maximum``, so they take floats or numpy arrays alike: the
partitioner calls them on whole tables at once.

Units: seconds, bytes, bytes per second.

PipeDream: Harlap et al., "PipeDream: Fast and Efficient Pipeline Parallel DNN Training",
arXiv:1806.03377.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from pipetrain.schedule.generators import warmup

Num = TypeVar("Num", float, np.ndarray)

SYNC_ALGORITHMS = ("ps", "ring")


def dp_sync_bytes(parameter_bytes: Num, replicas: Num, algorithm: str = "ps") -> Num:
    """Bytes one worker sends and receives to synchronize a stage's weights over its replicas.

    PipeDream §3.2 (profiling paragraph): with a parameter server, each of m workers moves
    ``4 (m - 1) |w| / m`` bytes. ``algorithm="ring"`` uses the ring allreduce volume
    ``2 (m - 1) |w| / m`` instead (reduce-scatter then allgather, Patarasuk & Yuan 2009); the paper
    does not use it. One replica moves nothing.

    Args:
        parameter_bytes: |w|, the stage's parameter bytes.
        replicas: m, workers of the stage.
        algorithm: ``ps`` (parameter server, the paper's) or ``ring``.
    """
    if algorithm not in SYNC_ALGORITHMS:
        raise ValueError(f"unknown sync algorithm {algorithm!r}; use one of {', '.join(SYNC_ALGORITHMS)}")
    factor = 4 if algorithm == "ps" else 2
    return factor * (replicas - 1) * parameter_bytes / replicas


def stage_time(compute_s: Num, sync_s: Num, replicas: Num, overlap: bool = True) -> Num:
    """T(i -> j, m) = max(sum of T_l, sum of W_l^m) / m, PipeDream §3.2.

    The seconds per minibatch of a stage of layers i..j replicated on m workers: the replicas take
    minibatches round-robin, so the stage finishes one every 1/m of its compute time, unless weight
    synchronization takes longer. The max assumes sync overlaps compute completely; the paper divides
    the sync term by m too, and so does the code.

    Args:
        compute_s: sum over the stage's layers of forward + backward seconds (T_l).
        sync_s: sum over the stage's layers of weight-sync seconds (W_l^m), i.e.
            ``dp_sync_bytes(...) / bandwidth``.
        replicas: m.
        overlap: False (ours) for ``(compute + sync) / m``: pipetrain's ``pipedream`` schedule syncs a
            replicated stage every round before a replica's next forward, so the sync adds to the compute
            (docs/planning.md, many workers).
    """
    return (np.maximum(compute_s, sync_s) if overlap else compute_s + sync_s) / replicas


def boundary_time(cut_bytes: Num, bandwidth: Num | float, latency_s: float = 0.0) -> Num:
    """2 * C_i, PipeDream §3.2 recurrence for A(j, m): activations of the cut after layer i go
    forward and their gradients (same size) come back, each taking C_i = a_i / bandwidth.

    The paper charges this once per boundary, whatever the replication of the stages beside it;
    so does the code. ``latency_s`` (ours: a measured per-message cost) is added to each C_i.
    """
    return 2 * (latency_s + cut_bytes / bandwidth)


def in_flight(replicas: int, workers_to_output: int) -> int:
    """Minibatches a replica of a stage holds in flight under PipeDream's 1F1B schedule.

    PipeDream §3.2 gives NOAM = ceil(workers / workers of the input stage) for the input stage; the
    same reasoning for a later stage counts the workers from it to the output stage. This is
    :func:`pipetrain.schedule.generators.warmup`, used so the planner and the schedule agree.

    Args:
        replicas: workers of the stage.
        workers_to_output: workers of this stage and every later one.
    """
    return warmup((replicas, workers_to_output - replicas), 0)


def stage_memory_bytes(parameter_bytes: Num, stashed_activation_bytes: Num, in_flight_count: Num,
                       input_bytes: Num | float = 0.0, recompute: bool = False,
                       weight_versions: Num | float | None = None) -> Num:
    """Bytes one replica of a stage holds: live weights, stashed weight versions (by default one per
    in-flight minibatch, PipeDream §3.4's weight stashing) and the activations each in-flight
    minibatch keeps for its backward pass.

    PipeDream states the memory limit without a formula; its released optimizer uses
    ``ceil(...) * (activations + weights)``. This counts the live weights as well and leaves out
    gradients and optimizer state, so give the limit less the memory those take.

    With ``recompute`` (ours) an in-flight (micro)batch keeps only its input, and the one whose
    backward runs holds its full activations again while it reruns its forward:
    ``input_bytes * (in_flight - 1) + stashed_activation_bytes``.

    Args:
        parameter_bytes: the stage's parameter bytes.
        stashed_activation_bytes: bytes one (micro)batch keeps on the stage until its backward,
            its input included.
        in_flight_count: from :func:`in_flight`, or the schedule's
            (:meth:`pipetrain.schedule.kinds.PipelineSchedule.in_flight`).
        input_bytes: bytes of one (micro)batch's input to the stage (with ``recompute``).
        recompute: activation recomputation.
        weight_versions: stashed weight versions beside the live ones (default ``in_flight_count``).
    """
    versions = in_flight_count if weight_versions is None else weight_versions
    activations = input_bytes * (in_flight_count - 1) + stashed_activation_bytes if recompute else \
        stashed_activation_bytes * in_flight_count
    return parameter_bytes * (1 + versions) + activations


def worker_memory_bytes(stage_bytes: Num, gradient_bytes: Num, optimizer_bytes: Num, sync_bytes: Num | float = 0.0,
                        baseline_bytes: float = 0.0) -> Num:
    """Bytes one worker holds at its peak: ``baseline + stage + gradients + optimizer state + sync copies``.

    ``stage_bytes`` is :func:`stage_memory_bytes` (weights, stashed versions, stashed activations). To
    it come the model states PipeDream leaves out: the gradients of the trainable parameters and the
    optimizer's state (ZeRO, Rajbhandari et al., arXiv:1910.02054, §3.1, counts a model's memory as
    parameters, gradients and optimizer states; here the optimizer's state is measured, not derived
    from its kind). Ours: ``sync_bytes``, the copies of the gradient a synchronizer holds while it
    agrees on it (:meth:`pipetrain.strategies.kinds.Strategy.sync_bytes`), and ``baseline_bytes``,
    what the worker process holds before its stage (on the CPU, torch itself:
    :func:`pipetrain.runtime.resident.baseline`; 0 on a GPU, whose allocator counts tensors only).

    Left out: temporaries of a single operation (an optimizer step's, a matmul's workspace) and the
    messages a worker is sending or receiving, each at most about one layer's or one cut's bytes.
    """
    return baseline_bytes + stage_bytes + gradient_bytes + optimizer_bytes + sync_bytes


def allreduce_copy_bytes(gradient_bytes: Num, replicas: Num) -> Num:
    """Bytes of the gradient copies a replica of a stage holds while its replicas allreduce it: a flat copy
    of each bucket, all of them until the sync ends (:class:`pipetrain.strategies.allreduce.ReplicaAllreduce`),
    the whole gradient; none on one replica. Ours (the runtime's, not a paper's)."""
    return gradient_bytes * (replicas > 1)


# -- Pipe-SGD: Li et al., "Pipe-SGD: A Decentralized Pipelined SGD Framework for Distributed Deep Net
# Training", NeurIPS 2018 (arXiv:1811.03619), §3.1. Notation: T iterations, l_up / l_comp / l_comm the
# seconds of one iteration's update, gradient computation (forward + backward) and communication.

def sync_sgd_time(iterations: Num, update_s: Num, compute_s: Num, comm_s: Num) -> Num:
    """Eq. 2: synchronous SGD runs update, compute and communication one after the other:
    ``l_total_sync = T (l_up + l_comp + l_comm)``."""
    return iterations * (update_s + compute_s + comm_s)


def pipe_sgd_ideal_time(iterations: Num, staleness: Num, update_s: Num, compute_s: Num, comm_s: Num) -> Num:
    """Eq. 3: Pipe-SGD with K iterations interleaved and unlimited compute and links:
    ``l_total_pipe = T / K (l_up + l_comp + l_comm)``."""
    return iterations / staleness * (update_s + compute_s + comm_s)


def pipe_sgd_time(iterations: Num, update_s: Num, compute_s: Num, comm_s: Num) -> Num:
    """Eq. 4: Pipe-SGD (K >= 2) on one compute resource and one link per worker is bound by the
    slower of the two: ``l_total_pipe = T max(l_up + l_comp, l_comm)``, whatever K."""
    return iterations * np.maximum(update_s + compute_s, comm_s)


def ring_allreduce_time(workers: Num, nbytes: Num, latency_s: Num, byte_s: Num, reduce_byte_s: Num,
                        sync_s: Num | float = 0.0, segments: Num | int = 1) -> Num:
    """The communication term of eq. 5 (``segments`` L = 1) and eq. 6 (L gradient segments, each
    allreduced on its own): ``2 (p-1) L α + 2 (p-1)/p n β + (p-1)/p n γ + L S``.

    A ring allreduce over p workers takes 2(p-1) steps, each sending one block of n/p bytes
    (reduce-scatter, then all-gather; Thakur et al. 2005), and reduces (p-1)/p n bytes.

    Args:
        workers: p.
        nbytes: n, the bytes of the gradient as sent (compressed: the codec's payload bytes, §3.2).
        latency_s: α, per message.
        byte_s: β, seconds per byte on the link (1 / bandwidth).
        reduce_byte_s: γ, seconds per byte to reduce a received block. With compression inside the
            ring it is what one reduce-scatter step costs per payload byte (decompress, add,
            compress), and the code also charges it for the all-gather's decompressions and the
            first compression (a departure: the paper's γ covers the sum only).
        sync_s: S, the global synchronization time per allreduce.
        segments: L.
    """
    return 2 * (workers - 1) * segments * latency_s + 2 * (workers - 1) / workers * nbytes * byte_s \
        + (workers - 1) / workers * nbytes * reduce_byte_s + segments * sync_s


def ring_allreduce_cpu_s(workers: Num, block_bytes: Num, step_cpu_s: Num, cpu_s_per_byte: Num) -> Num:
    """CPU seconds one rank spends in a ring allreduce, sending, receiving and adding included:
    ``2 (p-1) (a + b cpu_per_byte)``, each of its 2(p-1) steps moving one block of b bytes for a fixed
    ``step_cpu_s`` a and ``cpu_s_per_byte`` per byte.

    Ours: Pipe-SGD §3.1 prices the ring's wall time (:func:`ring_allreduce_time`) with a CPU to spare
    for it; its CPU counts when workers share cores (:func:`shared_core_compute_s`).
    """
    return 2 * (workers - 1) * (step_cpu_s + block_bytes * cpu_s_per_byte)


def pipe_sgd_sequential_time(iterations: Num, update_s: Num, forward_s: Num, backward_s: Num,
                             comm_s: Num) -> Num:
    """Eq. 5: Pipe-SGD communicating the whole gradient once per iteration, after the backward:
    ``T max(l_up + l_for + l_back, <ring term with L = 1>)``; ``comm_s`` is
    :func:`ring_allreduce_time` with ``segments=1``. This is what pipetrain's pipe-sgd runs."""
    return iterations * np.maximum(update_s + forward_s + backward_s, comm_s)


def pipe_sgd_pipelined_time(iterations: Num, update_s: Num, forward_s: Num, first_backward_s: Num,
                            comm_s: Num) -> Num:
    """Eq. 6: Pipe-SGD communicating each of L gradient segments as soon as the backward made it:
    ``T max(l_up + l_for + l_b, <ring term with L segments>)``, l_b the backward of the first segment
    and ``comm_s`` :func:`ring_allreduce_time` with ``segments=L``. When communication bound, eq. 5
    is smaller (L latencies and syncs instead of one), which is why pipetrain sends the gradient whole."""
    return iterations * np.maximum(update_s + forward_s + first_backward_s, comm_s)


def shared_core_compute_s(update_s: Num, compute_s: Num, comm_cpu_s: Num, cores_per_worker: float,
                          slowdown: float = 1.0) -> Num:
    """The compute side of eq. 4 (l_up + l_comp) when the communication thread has no core of its own.

    Ours, not the paper's: Pipe-SGD's workers compute on a GPU while a CPU communicates, so eq. 4
    takes the two as separate resources. A worker with fewer than 2 cores runs its allreduce's CPU
    work (copying the gradient out, the codec, the network stack's part of every send and receive)
    on the cores its compute uses, so that work adds to the compute side:
    ``l_up + l_comp + l_comm_cpu / min(1, cores_per_worker)`` (below one core each, the larger of that
    divisor's inverse and the slowdown: below); with 2 or more cores it overlaps and adds nothing.
    ``comm_cpu_s`` is CPU seconds: where workers outnumber the cores, every core is busy with their
    compute and the machine spreads that work over all of them, so each CPU second of it costs a worker
    1 / cores_per_worker seconds. Where the machine shares its cores less well than that, a CPU second
    costs what a second of compute does: the measured ``slowdown`` of all the workers computing at
    once, when it exceeds 1 / cores_per_worker. Where the set-up timed Pipe-SGD's loop itself, that is
    priced instead (:func:`shared_core_period_s`): it holds how the ring and the compute slow each other.
    """
    if cores_per_worker >= 2:
        return update_s + compute_s
    if cores_per_worker >= 1:
        return update_s + compute_s + comm_cpu_s
    return update_s + compute_s + comm_cpu_s * max(1.0 / cores_per_worker, slowdown)


def shared_core_period_s(period_s: Num, update_s: Num, mean_s: Num, link_ring_s: Num) -> Num:
    """Seconds per iteration of Pipe-SGD (K >= 2) whose workers share cores, from its loop as timed on
    them: ``max(period + l_up + mean, ring on the link alone)``. Ours, not the paper's: eq. 4 takes the
    compute and the communication as separate resources; where workers share cores, every CPU second of
    either slows the other, so the set-up times the loop itself, a training step with the ring of the
    step before beside it (:meth:`pipetrain.setup.Setup.period`). The update (its copy of the
    gradient included) and the division of the sum by p (``mean_s``) run on the same cores and add to
    it; no faster than the link moves the ring (``link_ring_s``: a link slower than the set-up's)."""
    return np.maximum(period_s + update_s + mean_s, link_ring_s)


def scaling_efficiency(update_s: Num, compute_s: Num, comm_s: Num) -> Num:
    """Eq. 7: actual over ideal speedup of Pipe-SGD on p workers at the single node's per-worker batch:
    ``SE = (l_up + l_comp) / max(l_up + l_comp, l_comm)``; 1 once compute bound."""
    return (update_s + compute_s) / np.maximum(update_s + compute_s, comm_s)


# -- CGDP: Le et al., "Involving CPUs into Multi-GPU Deep Learning", ICPE'18, §3.2. Units are layers
# with parameters, or chunks of them (§4.1), in backward order: unit 0 is the model's last, whose
# gradient exists first. Per unit: t_bp the backward seconds until its gradient exists (after the
# previous unit's), t_as the synchronisation before it is sent, t_aa the accumulation on the host
# (copy in and sum), t_bc the copy of the sum back.

def cgdp_unit_times(bp_s: list[float], as_s: list[float], aa_s: list[float], bc_s: list[float],
                    serial: bool = False) -> list[float]:
    """Eq. 1: T_BP^i = sum over units up to i of (t_bp + t_as), + t_aa^i + t_bc^i: when unit i's summed
    gradient is back on the worker, counted from the start of the backward.

    The paper's host accumulates different layers in parallel (§3.2: "t_aa of different layers are
    overlapped"); ``serial=True`` instead queues each unit's t_aa behind the previous unit's, as
    pipetrain's one summing thread per worker does (a departure, ours)."""
    out, clock, free = [], 0.0, 0.0
    for bp, sync, aa, bc in zip(bp_s, as_s, aa_s, bc_s):
        clock += bp + sync
        free = (max(clock, free) if serial else clock) + aa
        out.append(free + bc)
    return out


def cgdp_backward_s(bp_s: list[float], as_s: list[float], aa_s: list[float], bc_s: list[float],
                    tail_s: float = 0.0, serial: bool = False) -> float:
    """Eq. 1: T = max_i T_BP^i, the backward of CGDP with its gradients back. ``tail_s`` is backward
    time after the first layer with parameters (layers without any, before it in forward order), which
    the paper's layer list leaves out; the backward cannot end before it. ``serial``: see
    :func:`cgdp_unit_times`."""
    return max([*cgdp_unit_times(bp_s, as_s, aa_s, bc_s, serial), sum(bp_s) + sum(as_s) + tail_s])


def cgdp_overhead_s(bp_s: list[float], as_s: list[float], aa_s: list[float], bc_s: list[float],
                    tail_s: float = 0.0, serial: bool = False) -> float:
    """T_O = T - T_BP, T_BP the plain backward (sum of t_bp): the seconds CGDP adds per iteration. Eq. 2,
    T_O = sum t_as + t_aa^1 + t_bc^1, is the same when every unit but the last one's accumulation
    overlaps the backward of the next (:func:`cgdp_overhead_eq2`); this is the exact max of eq. 1."""
    return cgdp_backward_s(bp_s, as_s, aa_s, bc_s, tail_s, serial) - sum(bp_s) - tail_s


def cgdp_overhead_eq2(as_s: list[float], aa_s: list[float], bc_s: list[float]) -> float:
    """Eq. 2: T_O = sum_i t_as^i + t_aa^1 + t_bc^1 (layer 1, the last of the backward, is our last unit)."""
    return sum(as_s) + aa_s[-1] + bc_s[-1]


def overlapped_backward_s(bp_s: list[float], allreduce_s: list[float], tail_s: float = 0.0) -> float:
    """The backward of synchronous data parallelism that allreduces each bucket of gradients as soon as
    the backward has made it, one allreduce at a time (PyTorch DDP's buckets): eq. 1 with t_aa the
    bucket's allreduce, t_as = t_bc = 0, and the accumulations queued (``serial``). Units are the
    buckets in backward order; ``bp_s`` the backward until each bucket's gradients exist."""
    zeros = [0.0] * len(bp_s)
    return cgdp_backward_s(bp_s, zeros, allreduce_s, zeros, tail_s, serial=True)


def dp_overhead_s(aa_s: list[float], bc_s: list[float]) -> float:
    """§3.2: T'_O = sum_i (t_aa^i + t_bc^i), data parallelism accumulating and broadcasting every layer's
    gradient after the backward."""
    return sum(aa_s) + sum(bc_s)


def cgdp_wins(as_s: list[float], aa_s: list[float], bc_s: list[float]) -> bool:
    """§3.2's condition for CGDP to beat data parallelism: sum_i t_as^i < sum_{i=l..2} (t_aa^i + t_bc^i),
    every unit's synchronisation against the accumulation and broadcast of all but the last unit."""
    return sum(as_s) < sum(aa_s[:-1]) + sum(bc_s[:-1])


# -- The run set-up (ours, not the papers'): what the papers' models leave to "the network" and "the
# device", measured (pipetrain.setup.Setup) because on shared CPUs it decides the throughput.

def message_time(nbytes: Num, latency_s: Num, s_per_byte: Num) -> Num:
    """α + n β: one message of n bytes (the latency-bandwidth model of Thakur et al. 2005, which
    Pipe-SGD §3.1 uses for its ring); also the CPU one message costs an end, with α and β measured
    as CPU seconds."""
    return latency_s + nbytes * s_per_byte


def busy_latency_s(idle_s: float, busy_s: float, end_shares: Sequence[float]) -> float:
    """A message's latency between the two the set-up measures, ``idle_s`` (nothing else running in the
    two processes) and ``busy_s`` (a thread of each computing throughout), by how busy its two ends are:
    an end whose worker computes a share u of the time delays the message as a busy end does with
    chance u (its transport threads wait for the core and the interpreter its compute holds), so
    ``idle + (busy - idle) (1 - prod(1 - u))``; both ends always busy give ``busy_s`` (ours; the papers
    price a message by the link alone). Without an idle figure (0), ``busy_s``."""
    if idle_s <= 0:
        return busy_s
    both_idle = 1.0  # the chance that neither end computes
    for u in end_shares:
        both_idle *= 1.0 - min(max(u, 0.0), 1.0)
    return idle_s + max(busy_s - idle_s, 0.0) * (1.0 - both_idle)


def overlapped_ring_s(idle_s: float, busy_s: float, computing_s: float) -> float:
    """Our ring allreduce's time when the workers compute only for its first ``computing_s`` seconds
    (Pipe-SGD's K >= 2: iteration t+1's update and compute start with iteration t's allreduce), between
    the two the set-up measures, ``idle_s`` (nothing else running) and ``busy_s`` (a thread of every
    worker computing throughout): it moves at the busy rate while they compute and at the idle rate
    after, so ``idle + min(c, busy) (1 - idle / busy)``; ``busy_s`` when the compute lasts the whole
    ring or no idle figure was measured (0). Ours: the paper prices the ring by the link alone, but a
    ring whose workers compute beside it waits for cores at every step, so it runs at the busy rate
    only for as long as they compute."""
    if idle_s <= 0 or idle_s >= busy_s:
        return busy_s
    return idle_s + min(max(computing_s, 0.0), busy_s) * (1.0 - idle_s / busy_s)


def contended_s(seconds: Num, slowdown: float) -> Num:
    """Compute time when workers share cores: the time alone times the measured ``slowdown`` of all the
    machine's workers computing at once (ours; the papers give every worker a device of its own)."""
    return seconds * slowdown


def loading_wait_s(load_s: Num, loaders: int, compute_s: Num) -> Num:
    """Seconds per minibatch a worker's compute thread spends on data built by ``loaders`` background
    processes (0: it builds each minibatch itself, ``load_s``): taking turns, they have one ready every
    ``load_s / loaders`` seconds while the worker computes for ``compute_s``, so it waits for what the
    first exceeds the second (ours; assumes loading does not slow the compute: waits on storage, or
    spare cores)."""
    if loaders == 0:
        return load_s
    return np.maximum(load_s / loaders - compute_s, 0.0)


def overlap_slowdown(slowdown: float, others: float) -> float:
    """The slowdown of a worker's compute while, on average over it, a share ``others`` (0-1) of the
    machine's other workers compute too, where every worker's threads have cores of their own: between
    1 (it computes alone) and the measured ``slowdown`` of all of them computing at once (shared caches,
    memory bandwidth, the VM's cores), linearly: ``1 + (slowdown - 1) others`` (ours; the papers give
    every worker a device of its own). So a pipeline's bubbles leave a stage the machine to itself: a
    ``model-parallel`` stage, which computes while the others wait, runs at its speed alone
    (``python benchmarks/sim_vs_real.py`` sets each stage's replay alone beside the real runs)."""
    return 1.0 + (slowdown - 1.0) * min(max(others, 0.0), 1.0)


def stage_work_s(compute_s: Num, update_s: Num | float, copy_s: Num | float, message_cpu_s: Num | float,
                 slowdown: float) -> Num:
    """What one worker of a stage spends per minibatch beyond waiting: the sum of T_l of PipeDream §3.2
    (forward + backward), plus, ours, what the runtime adds that a layer profile does not hold: the
    optimizer step, the copy of a new weight version (weight stashing, §3.4), all ``slowdown`` times
    as long when workers share cores (:func:`contended_s`), and the CPU its messages take from it."""
    return contended_s(compute_s + update_s + copy_s, slowdown) + message_cpu_s



def straggler_s(work_s: Num, jitter_s: float, workers: Num) -> Num:
    """How much later than the mean worker the last of ``workers`` arrives at a synchronization after
    ``work_s`` seconds of compute each, all starting together: :func:`last_arrival_s` of equal arrivals,
    ``e_p sqrt(jitter_s work_s)``, e_p the expected maximum of p standard normals (0 for one worker).

    Ours: the papers' workers each have a device of their own and arrive together. Workers that share
    cores do not: time slicing makes each one's step take a different time, and a synchronization waits
    for the last of them (the set-up measures how much a step varies: ``jitter_s``).
    """
    if jitter_s == 0:  # no variation: nothing to wait for, and e_p costs a numerical integral per p
        return work_s * 0.0 * workers
    return np.vectorize(_expected_max_normal, otypes=[float])(workers) * np.sqrt(jitter_s * work_s)


def last_arrival_s(arrivals: list[float], work_s: float, jitter_s: float) -> float:
    """When the last of several workers is expected to arrive at a synchronization: E[max_i (a_i + σ Z_i)],
    a_i each one's arrival without variation (e.g. simulated), σ = sqrt(``jitter_s`` x ``work_s``) the
    standard deviation of the ``work_s`` seconds of compute it did since the last one
    (:attr:`pipetrain.setup.Setup.jitter_s`), the Z_i independent standard normals. Arrivals far
    apart are barely delayed: the last one comes as late as it varies, early or late; arrivals together
    by e_p σ (:func:`straggler_s`). Ours, as :func:`straggler_s` is."""
    top = max(arrivals)
    sigma = math.sqrt(jitter_s * work_s)
    if sigma <= 0 or len(arrivals) < 2:
        return top
    du = 16 * sigma / 1600  # the midpoints of 1600 steps over top ± 8 σ
    u = (torch.arange(1600, dtype=torch.float64) + 0.5) * du - 8 * sigma
    lead = torch.tensor([a - top for a in arrivals], dtype=torch.float64)
    below = torch.special.ndtr((u[:, None] - lead[None, :]) / sigma).prod(dim=1)  # P(max <= top + u)
    return top + du * float(torch.where(u >= 0, 1 - below, -below).sum())


@functools.cache
def _expected_max_normal(p: int) -> float:
    """E[max of p independent standard normals] (0.5642 for 2, 1.0294 for 4, 1.4236 for 8)."""
    return last_arrival_s([0.0] * p, 1.0, 1.0)
