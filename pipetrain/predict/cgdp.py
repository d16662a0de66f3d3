"""CPU-GPU data parallelism's predicted iteration (CGDP §3.2, eq. 1-2): chunks of layers summed in shared
host memory during the backward, priced per chunk and run through the simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipetrain import costs
from pipetrain.profiling import Profile
from pipetrain.schedule.generators import data_parallel
from pipetrain.simulate import Link, SimResult, simulate
from pipetrain.stagecost import shard_backward_s, shard_priced, stage_costs
from pipetrain.timing import torch_threads
from pipetrain.strategies import cgdp as cgdp_sums
from pipetrain.strategies.chunks import chunk_layout


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
        chunk: layers per chunk.
        copy_s_per_byte, sum_s_per_byte, signal_s: the host costs it was priced with.
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
    chunk: int
    copy_s_per_byte: float
    sum_s_per_byte: float
    signal_s: float
    sim: SimResult = field(repr=False)

    def to_dict(self) -> dict[str, object]:
        """Every field but the simulator's result, as JSON-ready data."""
        return {k: v for k, v in vars(self).items() if k != "sim"}

    def summary(self) -> str:
        """The prediction for people, in two lines."""
        return (f"{len(self.chunks)} chunks: {self.samples_per_s:.1f} samples/s, {self.iteration_s * 1e3:.1f} ms per "
                f"iteration\nbackward {self.plain_backward_s * 1e3:.1f} ms alone, {self.backward_s * 1e3:.1f} ms with "
                f"the host sums (eq. 1): overhead {self.overhead_s * 1e3:.2f} ms (eq. 2: {self.overhead_eq2_s * 1e3:.2f} "
                f"ms); data parallelism's {self.dp_overhead_s * 1e3:.2f} ms; CGDP "
                f"{'wins' if self.wins else 'does not win'} (§3.2)")


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
    [whole] = stage_costs(profile, [0], batch_size)
    mine = whole.share(workers)
    slowdown = 1.0 if profile.setup is None else profile.setup.slowdown
    priced, shard_slowdown = shard_priced(profile, whole, workers, batch_size)
    if update_s is None:
        update_s = costs.contended_s(whole.update_s, slowdown)
    if cores_per_worker is None:
        cores_per_worker = math.inf if profile.setup is None else profile.setup.cores_per_worker
    shard = shard_backward_s(profile, whole, workers, shard_slowdown)
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
    sim = simulate(data_parallel(workers, minibatches, name="cgdp"), priced, [0], Link(), batch_size,
                   update_s, sync_s=[overhead])
    batch = profile.batch_size if batch_size is None else batch_size
    iteration = costs.contended_s(mine.forward_s, shard_slowdown) + costs.contended_s(mine.batching_s, slowdown) + \
        backward + update_s
    return CGDPPrediction(
        samples_per_s=sim.samples_per_s or (batch / iteration if batch else 0.0), iteration_s=iteration,
        backward_s=backward, plain_backward_s=sum(bp) + tail_s, overhead_s=overhead,
        overhead_eq2_s=costs.cgdp_overhead_eq2(sync, aa, bc) if rows else 0.0,
        dp_overhead_s=costs.dp_overhead_s(aa, bc), wins=costs.cgdp_wins(sync, aa, bc) if rows else False,
        chunks=rows, chunk=chunk, copy_s_per_byte=copy_s_per_byte, sum_s_per_byte=sum_s_per_byte,
        signal_s=signal_s, sim=sim)


def host_costs(profile: Profile, workers: int, given: dict[str, float] | None = None) -> dict[str, float]:
    """What :func:`predict_cgdp` prices the host with: ``copy_s_per_byte`` and ``sum_s_per_byte`` as
    given, else measured here with the workers' thread count
    (:func:`pipetrain.strategies.cgdp.measure_host_costs`); ``signal_s`` as given, else a 1-element
    allreduce among the machine's workers priced from the profile's set-up (0 without one); and
    ``cores_per_worker`` where given."""
    found = dict(given or {})
    if "copy_s_per_byte" not in found or "sum_s_per_byte" not in found:
        with torch_threads(None if profile.setup is None else profile.setup.threads):
            found.update(cgdp_sums.measure_host_costs(min(profile.parameter_bytes // 4, 1 << 24), workers))
    if "signal_s" not in found:
        found["signal_s"] = 0.0 if profile.setup is None else float(costs.ring_allreduce_time(
            workers, 4.0, *profile.setup.allreduce_terms(ours=False), 0.0))
    return found


def predict_on_host(profile: Profile, workers: int, chunk: int, batch_size: int | None, host: dict[str, float],
                    update_s: float | None = None, minibatches: int | None = None) -> CGDPPrediction:
    """:func:`predict_cgdp` with the host costs :func:`host_costs` gives."""
    return predict_cgdp(profile, workers, chunk, batch_size, update_s=update_s,
                        copy_s_per_byte=host["copy_s_per_byte"], sum_s_per_byte=host["sum_s_per_byte"],
                        signal_s=host["signal_s"], cores_per_worker=host.get("cores_per_worker"),
                        **({"minibatches": minibatches} if minibatches else {}))


def best_chunk(profile: Profile, workers: int, batch_size: int | None, host: dict[str, float],
               update_s: float | None = None, minibatches: int | None = None) -> CGDPPrediction:
    """The prediction at the layers per chunk CGDP's cost model prices fastest with ``host``
    (:func:`host_costs`), every size priced as :func:`predict_on_host` prices one.

    [Note: fewest chunks] Of the sizes the model prices alike, the one with the fewest chunks: every
    chunk costs the backward more than the model charges it (its signals' CPU only, nothing with a core
    per worker), so fewer chunks are the safer pick (``python benchmarks/cgdp_chunks.py`` measures each
    chunk size's overhead).
    """
    units = sum(1 for x in profile.layers if x.parameter_bytes)
    found = {k: predict_on_host(profile, workers, k, batch_size, host, update_s, minibatches)
             for k in range(1, max(units, 1) + 1)}
    best = max(p.samples_per_s for p in found.values())
    return found[min((k for k, p in found.items() if p.samples_per_s >= best * (1 - 1e-9)),
                     key=lambda k: (len(found[k].chunks), k))]
