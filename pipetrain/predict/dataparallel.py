"""Data parallelism's predicted throughput: Pipe-SGD's timing models (§3.1, eq. 2-7), simulated and in
closed form, for our own ring allreduce with staleness and compression (Pipe-SGD) or the backend's
allreduce with its buckets inside the backward (DDP).

The caller says how the strategy synchronizes (staleness, codec, whose allreduce, overlapped buckets);
nothing here knows a strategy's name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pipetrain import costs
from pipetrain.profiling import Profile
from pipetrain.setup import Setup
from pipetrain.timing import torch_threads
from pipetrain.schedule.generators import data_parallel
from pipetrain.simulate import Link, SimResult, link_terms, simulate
from pipetrain.stagecost import StageCost, shard_backward_s, shard_priced, stage_costs
from pipetrain.strategies import ring
from pipetrain.strategies.compression import Codec, get_codec
from pipetrain.strategies.ddp import BUCKET_BYTES, FIRST_BUCKET_BYTES


@dataclass
class DataParallelPrediction:
    """What :func:`predict_data_parallel` predicts for a data-parallel strategy.

    Attributes:
        samples_per_s: from the simulator run over the strategy's own action lists.
        formula_samples_per_s: from the paper's closed form: Pipe-SGD eq. 4/5 for K >= 2, eq. 2 for
            synchronous SGD (K = 1).
        scaling_efficiency: Pipe-SGD eq. 7, (l_up + l_comp) / max(l_up + l_comp, l_comm).
        compute_s, update_s, comm_s: one worker's forward + backward on its shard (building the shard
            from the dataset included), optimizer step (with the allreduce's CPU when it shares the
            worker's cores), and one gradient allreduce (Pipe-SGD's ring model, eq. 5's communication
            term).
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

    def summary(self) -> str:
        """The prediction for people, in two lines."""
        return (f"{self.samples_per_s:.1f} samples/s simulated, {self.formula_samples_per_s:.1f} by the closed form"
                f"\nper iteration: compute {self.compute_s * 1e3:.1f} ms + update {self.update_s * 1e3:.1f} ms, "
                f"allreduce {self.comm_s * 1e3:.1f} ms of {self.payload_bytes:,} bytes: {self.bound} bound, "
                f"scaling efficiency {self.scaling_efficiency:.2f} (Pipe-SGD eq. 7)")


def predict_data_parallel(profile: Profile, workers: int, link: Link, batch_size: int | None = None, *,
                          staleness: int = 1, compression: str | None = None, own_ring: bool = False,
                          buckets_in_backward: bool = False, update_s: float | None = None,
                          reduce_s: float | None = None, comm_cpu_s: float | None = None,
                          cores_per_worker: float | None = None, minibatches: int = 32) -> DataParallelPrediction:
    """Predict a data-parallel strategy's throughput from a profile (Pipe-SGD §3.1, eq. 2-7).

    Every worker runs the whole model on batch/``workers`` samples; one gradient allreduce is a ring
    over ``workers`` (:func:`pipetrain.costs.ring_allreduce_time`, with ``link``'s latency and
    bandwidth and the codec's payload bytes), one at a time on a communication thread.

    Args:
        profile: per-layer costs of the whole model.
        workers: p.
        link: each worker's link (α = latency, β = 1 / bandwidth).
        batch_size: samples per minibatch of the whole job (default: the profile's).
        staleness: K, Pipe-SGD's staleness: the gradient of minibatch t is applied after the backward
            of t + K - 1; 1 is synchronous SGD (eq. 2), K >= 2 overlaps the allreduce with compute
            (eq. 4-5).
        compression: the codec inside our own ring (:func:`pipetrain.strategies.compression.get_codec`);
            needs ``own_ring``.
        own_ring: the allreduce is our own ring on the worker's communication thread
            (:mod:`pipetrain.strategies.ring`, as Pipe-SGD runs it), not the backend's ``all_reduce``
            (as DDP runs it). With a measured set-up it is priced with our ring's measured terms
            (busy and idle), the update copies the gradient out of ``.grad``, the ring's thread divides
            the sum into the mean, and where workers share cores and K >= 2 the set-up's timing of
            this loop (:meth:`~pipetrain.setup.Setup.period`) stands for an iteration.
        buckets_in_backward: the gradient is allreduced in buckets
            (:data:`pipetrain.strategies.ddp.BUCKET_BYTES`) as the backward makes them, as DDP does: a
            worker waits after its backward only for what those allreduces did not finish (``comm_s``
            stays one allreduce of the whole gradient). Else the whole gradient is allreduced after
            the backward.
        update_s: seconds per optimizer step (default: the profile's optimizer seconds).
        reduce_s: seconds of codec arithmetic per allreduce (γ's total); default measured here with
            :func:`pipetrain.strategies.ring.ring_compute_seconds`, with a measured set-up as slow as
            its other compute, less the plain adds a measured ring's seconds per byte already hold.
        comm_cpu_s, cores_per_worker: CPU seconds one allreduce costs a worker, and the cores each
            worker has: with fewer than 2 and K >= 2, the compute side carries that CPU too
            (:func:`pipetrain.costs.shared_core_compute_s`; the simulator charges it to ``U``). Default:
            from the profile's measured set-up (our ring's CPU alone with the codec at this gradient,
            :meth:`~pipetrain.setup.Setup.codec_ring_cpu`, where measured, else the plain ring's,
            :meth:`~pipetrain.setup.Setup.ring_cpu`, and the codec's arithmetic beyond its adds;
            then the mean), else 0 and unlimited. Where the set-up timed our own ring's loop at this
            gradient, codec and workers (workers sharing cores: :meth:`~pipetrain.setup.Setup.period`)
            and K >= 2, neither given, an iteration is that loop's time, the update and the mean added
            (:func:`pipetrain.costs.shared_core_period_s`), as ``comm_s``, and no CPU is charged apart.
        minibatches: how many the simulator runs (its rate is taken between the first and last update).

    With a measured set-up in the profile, compute takes its ``slowdown`` times as long, and every ring
    step the measured allreduce's latency more (our ring's or the backend's), at the slower of the
    link's and the measured ring's seconds per byte (our ring's between its line measured idle, or
    timed idle at the job's gradient and codec, and busy, by how long the workers compute beside it:
    :func:`pipetrain.costs.overlapped_ring_s`).

    Raises:
        ValueError: ``compression`` without ``own_ring``, or staleness < 1.
    """
    if compression is not None and not own_ring:
        raise ValueError(f"compression={compression!r} runs inside our own ring allreduce (own_ring=True); "
                         "the backend's allreduce takes no compression")
    if staleness < 1:
        raise ValueError(f"staleness={staleness} must be at least 1 (1 is synchronous SGD)")
    k = staleness
    codec = get_codec(compression)
    batch = profile.batch_size if batch_size is None else batch_size
    [whole] = stage_costs(profile, [0], batch_size)
    setup = profile.setup
    slowdown = 1.0 if setup is None else setup.slowdown
    priced, shard_slowdown = shard_priced(profile, whole, workers, batch_size)
    # a worker builds its shard of the minibatch, then runs its forward and backward on it
    build_s = costs.contended_s(whole.batching_s / workers, slowdown)
    compute_s = costs.contended_s((whole.forward_s + whole.backward_s) / workers, shard_slowdown) + build_s
    if update_s is None:  # as the simulator does: a caller's update_s is taken as given
        update_s = costs.contended_s(whole.update_s, slowdown)
    elements = whole.parameter_bytes // 4  # float32 gradients
    payload = workers * codec.payload_bytes(ring.block_size(elements, workers, codec.granule), torch.float32)
    # workers sharing cores: the set-up may have timed this job's own loop (a step, the ring of the one
    # before beside it), which holds what their compute, ring and codec take from each other
    period = None if setup is None or not own_ring or k < 2 or comm_cpu_s is not None or \
        cores_per_worker is not None else setup.period(codec.name, workers, whole.parameter_bytes)
    with torch_threads(None if setup is None else setup.threads):  # as a worker's communication thread runs it
        arithmetic = ring.ring_compute_seconds(codec, elements, workers) \
            if period is None and (reduce_s is None or comm_cpu_s is None) else 0.0
        # beyond the plain adds, which a measured ring's seconds per byte and CPU hold already
        plain = arithmetic if not codec.lossy or not arithmetic else \
            ring.ring_compute_seconds(get_codec(None), elements, workers)
    extra = max(0.0, arithmetic - plain)
    if reduce_s is None:
        reduce_s = costs.contended_s(arithmetic if setup is None or setup.ring_s_per_byte == 0 else extra, slowdown)
    gamma = reduce_s / ((workers - 1) / workers * payload) if workers > 1 else 0.0
    latency, byte_s = link_terms(link, setup, allreduce="ours" if own_ring else "backend",
                                 nbytes=whole.parameter_bytes)
    # the link's own ring time: no prediction from a set-up's timings is faster than that
    link_ring_s = costs.ring_allreduce_time(workers, payload, *link_terms(link, None), 0.0)
    if own_ring and setup is not None:  # our ring's A copies the gradient out of .grad on the compute thread
        update_s += costs.contended_s(whole.parameter_bytes * setup.copy_s_per_byte, slowdown)
    # after our ring, its thread divides the sum by p: one pass over the gradient, priced as an add
    mean_s = whole.parameter_bytes * setup.add_s_per_byte if own_ring and setup is not None else 0.0
    if period is not None:  # the update, its copy and the mean compete for the same cores: they add to it
        # the loop's step did not build its shard of the minibatch: that adds to it too
        comm_s = float(costs.shared_core_period_s(period + build_s, update_s, costs.contended_s(mean_s, slowdown),
                                                  link_ring_s))
        comm_cpu_s = 0.0
    else:
        ring_s = costs.ring_allreduce_time(workers, payload, latency, byte_s, gamma)
        if own_ring and setup is not None:
            # busy while the workers compute beside it (K >= 2), idle after: the job's own ring as the
            # set-up timed it idle (no faster than the link allows), else the idle line
            timed = setup.idle_ring(codec.name, workers, whole.parameter_bytes)
            idle_s = costs.ring_allreduce_time(workers, payload, *link_terms(link, setup, "ours", idle=True),
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
    # buckets allreduced during the backward (as DDP does): a worker waits only for what is left after it
    waited_s = _waited_after_backward_s(profile, whole, workers, shard_slowdown, latency, byte_s) \
        if buckets_in_backward and workers > 1 else comm_s
    sim = simulate(data_parallel(workers, minibatches, k), priced, [0], link, batch_size, step_s, sync_s=[waited_s])
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
    (:meth:`~pipetrain.setup.Setup.codec_ring_cpu`), else the plain ring's CPU at the payload's
    blocks and ``arithmetic_s`` (the codec's work beyond what that holds)."""
    measured = setup.codec_ring_cpu(codec.name, workers, gradient_bytes) if codec.lossy else None
    return measured if measured is not None else setup.ring_cpu(workers, payload / workers) + arithmetic_s


def _waited_after_backward_s(profile: Profile, whole: StageCost, workers: int, slowdown: float,
                             latency_s: float, byte_s: float) -> float:
    """Seconds a DDP worker waits for its allreduces after its own backward: its buckets
    (:data:`pipetrain.strategies.ddp.BUCKET_BYTES`, the first one smaller), in backward order, each
    allreduced (a ring) as soon as the backward has made it, one at a time
    (:func:`pipetrain.costs.overlapped_backward_s`)."""
    mine = shard_backward_s(profile, whole, workers, slowdown)
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
