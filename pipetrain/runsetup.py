"""The run set-up a profile is taken for, measured: what a message costs and how workers that share
cores slow each other.

A layer profile times each layer alone in one process. The runtime's workers are several processes:
on one machine they share its cores, and every message between them costs time on the wire and CPU
at both ends (the transport's threads, gloo's I/O loop). :func:`measure_setup` measures both with the
runtime's own launcher and transport, and the simulator, the planner and the data-parallel timing
models read them from :class:`Setup` through :mod:`pipetrain.costs`.
"""
from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipetrain import costs
from pipetrain.strategies.allreduce import BUCKET_BYTES
from pipetrain.strategies.compression import CODECS, Codec

MESSAGE_SIZES = (4096, 1 << 20)
"""Bytes of the two ping-pong messages a line (latency + bytes x seconds per byte) is drawn through."""


@dataclass(frozen=True)
class Setup:
    """How a job's workers run, measured on the machine (see :func:`measure_setup`).

    Attributes:
        backend: ``gloo`` or ``nccl``.
        workers: worker processes sharing this machine when measured.
        threads: torch threads per worker.
        cores: the machine's cores (``os.cpu_count()``).
        slowdown: mean compute time per step with all ``workers`` computing at once, over the same
            alone (1: no contention; 2: four single-thread workers on two cores).
        latency_s, s_per_byte: one message's one-way time between two workers while every worker computes,
            as a line through two sizes (:data:`MESSAGE_SIZES`).
        idle_latency_s: the same line's latency with nothing else running in the two processes; 0 when
            not measured (a message then always takes ``latency_s``: see
            :func:`pipetrain.costs.busy_latency_s`).
        message_cpu_s, message_cpu_s_per_byte: CPU seconds a message costs one end (all the threads of
            the process: transport, gloo) with nothing else running in the process, as a line through
            the same sizes.
        computing_message_cpu_s, computing_message_cpu_s_per_byte: the same for a message sent or
            received right after a training step, as a job's workers send theirs (the step's own CPU
            left out); 0 when not measured, and the idle line stands in. A job's messages pay this one
            (:meth:`shared_cpu`): see :data:`COMPUTING_ROUNDS_SECONDS`.
        copy_s_per_byte: copying memory (a stashed weight version, a gradient buffer).
        ring_latency_s, ring_s_per_byte: our ring allreduce over all the workers while every worker
            computes (α and β of :func:`pipetrain.costs.ring_allreduce_time`: n bytes over p workers take
            2(p-1) α + 2(p-1)/p n β), from two sizes (:func:`_ring_line`); 0 when not measured (a
            profile saved before they were), and the message figures stand in.
        idle_ring_latency_s, idle_ring_s_per_byte: the same ring's line with nothing else running (what
            a ring met while the workers compute only part of it is priced between the two:
            :func:`pipetrain.costs.overlapped_ring_s`); 0 when not measured (a pipeline's set-up, which
            leaves our ring's CPU unmeasured too), and the ring is priced busy.
        idle_ring_s: seconds one whole ring allreduce of a gradient of ``ring_cpu_bytes`` took with each
            codec (by name, ``none`` included), nothing else running, timed with its CPU
            (:func:`_ring_alone`): the job's own ring, its codec's work included, where the idle line
            holds neither (see :meth:`idle_ring`); empty when not measured.
        allreduce_latency_s: α of the backend's own allreduce (what DDP, a replicated stage's buckets
            and CGDP's signals use): a 1-element ``all_reduce`` among all the workers arriving
            staggered, from the last rank's call, over its 2(p-1) steps (:func:`_allreduce_at_sync`); 0
            when not measured.
        allreduce_s_per_byte, allreduce_bytes: β of the same allreduce, from the same probe of a
            gradient of ``allreduce_bytes`` (the job's, at most a replicated stage's bucket) beside the
            1-element one (the line through the two: 2(p-1) α + 2(p-1)/p n β), for gradients up to that
            size (:meth:`allreduce_terms`); 0 when not measured (the measured ring's β stands in).
        jitter_s: how much a worker's compute time varies with all ``workers`` computing at once, as a
            variance per second of compute: work of d seconds takes d ± sqrt(``jitter_s`` d) (one
            standard deviation; :func:`_jitter`); 0 when not measured.
        allreduce_cpu_s: CPU seconds a worker spends in one 1-element ``all_reduce`` of the backend (a
            signal: CGDP sends two per chunk), waiting for the others included (:func:`_allreduce_at_sync`);
            0 when not measured.
        ring_cpu_s, ring_cpu_s_per_byte: CPU seconds a rank spends in one step of our ring allreduce,
            fixed and per byte of its block (:func:`pipetrain.costs.ring_allreduce_cpu_s`), with nothing
            else running (:func:`_ring_cpu`); 0 when not measured, and the message figures stand in.
        codec_ring_cpu_s, ring_cpu_bytes: CPU seconds a rank spends in one whole ring allreduce of a
            gradient of ``ring_cpu_bytes`` with each lossy codec (by name), with nothing else running,
            as the plain ring's CPU is measured (:func:`_ring_cpu`); empty and 0 when not measured (the
            plain ring's line and the codec's arithmetic timed apart stand in: see
            :meth:`codec_ring_cpu`).
        add_s_per_byte: adding memory into memory of the same size, per byte of one of them (a
            microbatch's gradients added into ``.grad``); 0 when not measured.
        step_s, step_rows: the seconds one call of the measured kernel took with all ``workers`` calling
            it at once (the median over the rounds of their mean), and, when the kernel was a training
            step of the model (:func:`model_step`), the rows of its batch; 0 when not measured or not a
            model step. A step at a data-parallel worker's shard prices that worker's forward and
            backward directly (:func:`pipetrain.simulate.predict_data_parallel`).
        resampled_s: seconds the compute rounds went on past the first because the slowdown read more
            than the cores explain (:func:`_compute_rounds`); 0 when it did not, or not measured.
        period_s: where the workers share cores, seconds per iteration of pipe-sgd's own loop at K = 2
            with each codec (by name, ``none`` included) at a gradient of ``ring_cpu_bytes``: the
            kernel, then the ring of the step before it, which ran beside it (:func:`_period`; see
            :meth:`period`); empty when not measured.
    """

    backend: str
    workers: int
    threads: int
    cores: int
    slowdown: float
    latency_s: float
    s_per_byte: float
    message_cpu_s: float
    message_cpu_s_per_byte: float
    copy_s_per_byte: float
    ring_latency_s: float = 0.0
    ring_s_per_byte: float = 0.0
    allreduce_latency_s: float = 0.0
    allreduce_s_per_byte: float = 0.0
    allreduce_bytes: int = 0
    jitter_s: float = 0.0
    allreduce_cpu_s: float = 0.0
    ring_cpu_s: float = 0.0
    ring_cpu_s_per_byte: float = 0.0
    add_s_per_byte: float = 0.0
    idle_latency_s: float = 0.0
    step_s: float = 0.0
    step_rows: int = 0
    codec_ring_cpu_s: dict[str, float] = field(default_factory=dict)
    ring_cpu_bytes: int = 0
    resampled_s: float = 0.0
    idle_ring_latency_s: float = 0.0
    idle_ring_s_per_byte: float = 0.0
    idle_ring_s: dict[str, float] = field(default_factory=dict)
    period_s: dict[str, float] = field(default_factory=dict)
    computing_message_cpu_s: float = 0.0
    computing_message_cpu_s_per_byte: float = 0.0

    @property
    def cores_per_worker(self) -> float:
        """Cores each worker has to itself: the machine's over its workers."""
        return self.cores / max(self.workers, 1)

    def allreduce_terms(self, ours: bool, idle: bool = False, nbytes: float | None = None) -> tuple[float, float]:
        """(α, β) of a gradient allreduce among the workers: ``ours`` our ring's
        (:mod:`pipetrain.strategies.ring`, pipe-sgd's), else the backend's ``all_reduce`` of a gradient
        of ``nbytes``. ``idle``: our ring's with nothing else running, where it was measured. The
        backend's β is its own, measured at sync, for a gradient no larger than the one probed (at most
        one bucket: allreduced after the backward, with nothing computing); a larger gradient's buckets
        are mostly allreduced while the backward computes, and move at the measured ring's busy rate,
        as ``nbytes`` None does. In a set-up without them, a message's latency and seconds per byte
        stand in for the ring's.

        Ours: priced at the backend's own β at sync, DDP's vgg-like (107 MB, 2 workers) read 178
        samples/s against 147 measured (its 1 MiB probe 1.0 ns/B), where the busy ring's β had priced
        130 against 132."""
        if ours and idle and self.idle_ring_latency_s + self.idle_ring_s_per_byte > 0:
            return self.idle_ring_latency_s, self.idle_ring_s_per_byte
        latency = self.ring_latency_s if ours else self.allreduce_latency_s
        at_sync = not ours and nbytes is not None and nbytes <= self.allreduce_bytes and self.allreduce_s_per_byte > 0
        ring_per_byte = self.ring_s_per_byte if self.ring_s_per_byte > 0 else self.s_per_byte
        return latency if latency > 0 else self.latency_s, self.allreduce_s_per_byte if at_sync else ring_per_byte

    def message_cpu(self, nbytes: float) -> float:
        """CPU seconds one message of ``nbytes`` costs one of its ends."""
        return costs.message_time(nbytes, self.message_cpu_s, self.message_cpu_s_per_byte)

    def ring_cpu(self, workers: int, block_bytes: float) -> float:
        """CPU seconds one rank spends in our ring allreduce over ``workers``, each step moving a block of
        ``block_bytes``, as measured alone: the ring's own line, or in a set-up saved without it a send
        and a receive of the block per step."""
        if self.ring_cpu_s > 0:
            return costs.ring_allreduce_cpu_s(workers, block_bytes, self.ring_cpu_s, self.ring_cpu_s_per_byte)
        return 2 * costs.ring_allreduce_cpu_s(workers, block_bytes, self.message_cpu_s, self.message_cpu_s_per_byte)

    def codec_ring_cpu(self, codec: str, workers: int, nbytes: int) -> float | None:
        """CPU seconds one rank spent in our ring allreduce of ``nbytes`` of gradient over ``workers``
        with ``codec``, as measured in this set-up; None where it was not measured for that codec, those
        workers and that size.

        Ours: priced from the plain ring's line at the payload's bytes plus the codec's arithmetic timed
        apart, a codec's ring came out short of what it costs: vgg-like on 2 workers, 68 and 67 ms
        (trunc16, quant8) against 68-83 and 75-81 ms measured alone; mnist-mlp on 4, 9.1 and 7.8 against
        9.2-13.8 and 10.7-12.5 (its blocks travel in 5 and 3 chunks where the line assumes fewer bytes
        cost less, and the arithmetic runs per chunk: 1.4 and 2.6 ms against 0.6 and 1.2 timed whole)."""
        return self._at_job(self.codec_ring_cpu_s, codec, workers, nbytes)

    def idle_ring(self, codec: str, workers: int, nbytes: int) -> float | None:
        """Seconds our ring allreduce of ``nbytes`` of gradient over ``workers`` with ``codec`` took with
        nothing else running, as measured in this set-up; None where it was not measured for that codec,
        those workers and that size.

        Ours: the idle line (α, β) and the codec's arithmetic timed apart missed how a codec's ring runs
        where workers share cores. On 4 emulated hosts at 1 Gbit/s (2 cores), mnist-mlp's plain ring
        moved its bytes at the line's rate, but its quant8 ring, a quarter of the bytes, ran an
        iteration in 26-30 ms where the line and arithmetic priced 21."""
        return self._at_job(self.idle_ring_s, codec, workers, nbytes)

    def period(self, codec: str, workers: int, nbytes: int) -> float | None:
        """Seconds per iteration of pipe-sgd's loop at K = 2 (a training step, the ring of the step before
        beside it) over ``workers`` with ``codec`` at ``nbytes`` of gradient, as measured in this set-up;
        None where it was not (workers with cores of their own, another codec, workers or size).

        Ours: where workers share cores, the ring's CPU and the compute slow each other by more than
        either's own measurement says. mnist-mlp's 4 workers on 2 cores: a CPU second of the ring,
        charged at 2 (the workers per core), priced 21-23 ms where its iterations took 26 ms on the
        emulated cluster; charged at the compute's slowdown, which read 2.25-2.81 from one set-up to
        the next, its predictions on loopback ran 2525-3546 samples/s against 3016-4116 measured.
        Timed as the workers run it, the loop took 26.0-30.2 ms in 11 of 12 probes of 12 iterations (20.9 in one)."""
        return self._at_job(self.period_s, codec, workers, nbytes)

    def _at_job(self, table: dict[str, float], codec: str, workers: int, nbytes: int) -> float | None:
        """``table``'s entry for ``codec`` where the set-up measured it for ``workers`` and ``nbytes``."""
        if workers != self.workers or nbytes != self.ring_cpu_bytes:
            return None
        return table.get(codec)

    def shared_cpu(self, nbytes: float) -> float:
        """Seconds one message end takes from the worker's compute: none with 2 or more cores each, else
        its CPU after a training step, where measured (its transport threads then run on the cores it
        computes on), over the worker's share of a core where workers outnumber the cores
        (:func:`pipetrain.costs.shared_core_compute_s`)."""
        cpu = costs.message_time(nbytes, self.computing_message_cpu_s, self.computing_message_cpu_s_per_byte) \
            if self.computing_message_cpu_s + self.computing_message_cpu_s_per_byte > 0 else self.message_cpu(nbytes)
        return costs.shared_core_compute_s(0.0, 0.0, cpu, self.cores_per_worker)

    @staticmethod
    def from_dict(data: Any, field_of: Callable[..., Any]) -> Setup:
        """The set-up ``data`` holds; ``field_of(entry, key, where, kind)`` reads and checks one field
        (:func:`pipetrain.profiling._field`); ValueError naming the field otherwise."""
        if not isinstance(data, dict):
            raise ValueError(f"profile: 'setup' is {data!r:.40}, not an object")
        kinds = {"backend": str, "workers": int, "threads": int, "cores": int, "step_rows": int, "ring_cpu_bytes": int}
        by_codec = ("codec_ring_cpu_s", "idle_ring_s", "period_s")
        values: dict[str, Any] = {f.name: field_of(data, f.name, "setup", kinds.get(f.name, float),
                                                   None if f.default is MISSING else f.default)
                                  for f in fields(Setup) if f.name not in by_codec}
        for name in by_codec:
            table = data.get(name, {})
            if not isinstance(table, dict):
                raise ValueError(f"profile: 'setup.{name}' is {table!r:.40}, not an object")
            values[name] = {str(k): field_of(table, k, f"setup.{name}", float) for k in table}
        return Setup(**values)

    def describe(self) -> str:
        """One line for people."""
        return (f"{self.workers} workers x {self.threads} threads on {self.cores} cores (compute {self.slowdown:.2f}x "
                f"slower all at once), {self.backend} message {1e6 * self.latency_s:.0f} us (idle "
                f"{1e6 * self.idle_latency_s:.0f}) + {1e9 * self.s_per_byte:.2f} ns/B, CPU {1e6 * self.message_cpu_s:.0f} us "
                f"per end (after a step {1e6 * self.computing_message_cpu_s:.0f} us + "
                f"{1e9 * self.computing_message_cpu_s_per_byte:.2f} ns/B), ring "
                f"{1e6 * self.ring_latency_s:.0f} us per step + {1e9 * self.ring_s_per_byte:.2f} ns/B (idle "
                f"{1e6 * self.idle_ring_latency_s:.0f} us + {1e9 * self.idle_ring_s_per_byte:.2f} ns/B), "
                f"{self.backend} allreduce {1e6 * self.allreduce_latency_s:.0f} us per step + "
                f"{1e9 * self.allreduce_s_per_byte:.2f} ns/B (at {self.allreduce_bytes} B) and "
                f"{1e6 * self.allreduce_cpu_s:.0f} us of CPU, ring CPU {1e6 * self.ring_cpu_s:.0f} us per step + "
                f"{1e9 * self.ring_cpu_s_per_byte:.2f} ns/B"
                + "".join(f", {name} ring {1e3 * s:.1f} ms of CPU" for name, s in self.codec_ring_cpu_s.items())
                + "".join(f", {name} ring {1e3 * s:.1f} ms idle" for name, s in self.idle_ring_s.items())
                + "".join(f", {name} pipe-sgd iteration {1e3 * s:.1f} ms" for name, s in self.period_s.items())
                + f", 10 ms of compute "
                f"± {1e3 * (0.01 * self.jitter_s) ** 0.5:.1f} ms"
                + (f", a training step of {self.step_rows} rows {1e3 * self.step_s:.1f} ms all at once" if self.step_rows else "")
                + (f", compute re-sampled for {self.resampled_s:.1f} s" if self.resampled_s else ""))


Launcher = Callable[[Callable[..., Any], tuple, int], list[Any]]
"""``launch(fn, args, world)``: run ``fn(*args)`` as ranks 0..world-1 and return their results."""


SETTLE_EXCESS = 1.5
"""How far a set-up's compute slowdown may exceed what the cores explain (:func:`_compute_rounds`)
before the rounds are taken again. lstm-lm's step on 2 workers, 2 cores, 284 rounds back to back over
240 s: 249 read 0.85-1.27x; 33 read 1.70-1.81x, in spells of one round to about 12 s, while the VM
ran its two cores as one (one process alone kept its speed)."""

SETTLE_SECONDS = 12.0
"""The longest :func:`_compute_rounds` goes on taking rounds for a reading the cores explain."""


def measure_setup(workers: int, threads: int, kernel: Callable[[], Any] | None = None, seconds: float = 0.3,
                  rounds: int = 20, timeout: float = 60.0, launch: Launcher | None = None,
                  compute_rounds: int = 3, ring_bytes: int | None = None, ring_cpu: bool = True,
                  settle_s: float = SETTLE_SECONDS) -> Setup:
    """Measure the set-up of ``workers`` worker processes of ``threads`` torch threads on this machine.

    It starts max(2, ``workers``) processes with ``launch`` (default: the runtime's launcher; the
    emulated cluster's puts each on its own host). Compute, ``compute_rounds`` times: rank 0 runs
    ``kernel`` (default: a float32 matmul; pass one training step of the model for a faithful
    figure) alone for ``seconds``, then every rank runs it at once; ``slowdown`` is the median over
    the rounds of the ranks' mean time per call over rank 0's alone, and ``jitter_s`` the median of
    how much those calls varied (:func:`_jitter`); where the slowdown reads more than the cores explain,
    rounds go on for up to ``settle_s`` (:func:`_compute_rounds`). Messages: ranks 0 and 1 play
    ping-pong through the runtime's :class:`~pipetrain.runtime.transport.Transport` at each of :data:`MESSAGE_SIZES`, one way being
    half a round trip: first with nothing else running in the two processes, for the idle latency and
    the CPU time per message end (and the backend's ``all_reduce`` of 1 element among every rank, as a job's sync meets
    it: :func:`_allreduce_at_sync`); then while a thread of every rank runs ``kernel``, as the compute
    threads of a running job do, for the time per message (its transport threads then wait for a core)
    and our ring's line. Our ring's CPU is measured with nothing else running (:func:`_ring_cpu`) at
    ``ring_bytes`` (the job's gradient: pass the model's parameter bytes) and a quarter of it, and at
    ``ring_bytes`` with each lossy codec (unless it is below 4 x 64 KB or above
    :data:`RING_CPU_MAX_BYTES`), else at two of :data:`RING_BYTES` and with no codec. Only pipe-sgd's
    prediction reads our ring's CPU: with ``ring_cpu=False`` (a pipeline's planning) it is not
    measured: a vgg-like job's set-up (a 107 MB gradient, 2 workers, loopback) took 7.5-8.2 s without it
    and 12.0-15.9 s with it, and on a slow link each of those rings takes seconds.
    """
    from pipetrain.runtime.launch import spawn

    kernel = kernel or functools.partial(_matmul, 256)
    run = launch or (lambda fn, args, world: spawn(fn, world, args, describe="set-up probe {}".format))
    big = RING_BYTES[2] if ring_bytes is None else min(RING_CPU_MAX_BYTES, max(ring_bytes, 4 * RING_BYTES[0]))
    sizes = (RING_BYTES[1], big) if ring_bytes is None else (big // 4, big)
    codec_bytes = big if big == ring_bytes and ring_cpu else 0  # where a job's gradient can match it
    shared = workers >= 2 and workers * threads > (os.cpu_count() or 1)
    allreduce_bytes = min(BUCKET_BYTES, ring_bytes or BUCKET_BYTES)
    results = run(_probe, (workers, threads, kernel, seconds, rounds, timeout, compute_rounds, settle_s,
                           sizes if ring_cpu else None, codec_bytes, shared, allreduce_bytes),
                  max(2, workers))
    return Setup(**results[0])


@dataclass(frozen=True)
class ModelStep:
    """A kernel for :func:`measure_setup`: one forward and backward of ``model`` on ``batch`` (an
    ``(input, target)`` pair), the work the workers of a job share the cores with."""

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
        self.loss_fn(self.model(x), y).backward()
        self.model.zero_grad(set_to_none=True)


def model_step(model: torch.nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> ModelStep:
    """A :class:`ModelStep` kernel of ``model`` on ``batch`` with ``loss_fn``."""
    return ModelStep(model, batch, loss_fn)


def _matmul(n: int) -> None:
    a = torch.randn(n, n)
    (a @ a).sum().item()


def _run_for(kernel: Callable[[], Any], seconds: float, stop: threading.Event | None = None) -> list[float]:
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


def _jitter(calls: list[list[float]]) -> float:
    """:attr:`Setup.jitter_s` from every worker's call times in one round: the variance of all the calls
    about their common mean (a worker slower throughout counts, as it holds back the others at every
    sync), over that mean (the variance of work of d seconds grows as d when it is interrupted at random
    moments, as time slices are)."""
    pooled = [t for ts in calls for t in ts]
    return statistics.pvariance(pooled) / statistics.mean(pooled) if len(pooled) > 1 else 0.0


def _compute_rounds(workers: int, threads: int, kernel: Callable[[], Any], seconds: float, window: int,
                    settle_s: float, rank: int, device: torch.device) -> tuple[list[float], list[float], list[float],
                                                                               float]:
    """The compute rounds of :func:`_probe` (a collective: every rank calls it): rank 0 runs ``kernel``
    alone for ``seconds``, then ranks below ``workers`` run it at once, ``window`` times. Rank 0's
    ratio of the two (rank 0's rounds only: other ranks hold 1.0), the jitter and the step of each
    round, and the seconds spent re-sampling.

    Where the median ratio of the last ``window`` rounds is more than :data:`SETTLE_EXCESS` times
    what the cores explain (one, or the workers' threads over the cores where they outnumber them), the
    machine was taking cores from the job while it was sampled, which on this VM comes in spells of
    seconds: rounds go on, one at a time, until the last ``window`` read within it (those are kept) or
    ``settle_s`` has passed (every round is kept: the load is the machine's, and the job will meet it)."""
    import torch.distributed as dist

    explained = max(1.0, workers * threads / (os.cpu_count() or 1))
    ratios: list[float] = []
    jitters: list[float] = []
    steps: list[float] = []
    settling = 0.0
    while True:
        dist.barrier()
        alone = statistics.mean(_run_for(kernel, seconds)) if rank == 0 else 0.0
        dist.barrier()
        together = _run_for(kernel, seconds) if rank < workers else []
        times: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(times, together)
        ratios.append(statistics.mean(statistics.mean(t) for t in times[:workers]) / alone if rank == 0 else 1.0)
        jitters.append(_jitter(times[:workers]))
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
            return (ratios[-kept:], jitters[-kept:], steps[-kept:],
                    time.perf_counter() - settling if len(ratios) > window else 0.0)


def _probe(workers: int, threads: int, kernel: Callable[[], Any], seconds: float, rounds: int,
           timeout: float, compute_rounds: int, settle_s: float, ring_cpu_bytes: tuple[int, int] | None,
           codec_bytes: int, shared: bool, allreduce_bytes: int) -> dict[str, Any]:
    """One rank of :func:`measure_setup`; rank 0 returns the Setup's fields. ``ring_cpu_bytes``: the
    two gradients our ring's CPU is timed at (None: not timed); ``codec_bytes``: the one it is timed at
    with each lossy codec too (0: none), and, where the workers share cores (``shared``), pipe-sgd's
    loop with each codec (:func:`_period`); ``allreduce_bytes``: the gradient the backend's allreduce
    is timed at beside 1 element."""
    import torch.distributed as dist

    from pipetrain.runtime.dist import init_distributed
    from pipetrain.runtime.transport import Transport

    torch.set_num_threads(threads)
    device = init_distributed(timeout)
    rank = dist.get_rank()
    ratios, jitters, steps, resampled = _compute_rounds(workers, threads, kernel, seconds, compute_rounds, settle_s,
                                                         rank, device)
    slowdown, step_s = (statistics.median(ratios) if workers > 1 else 1.0), statistics.median(steps)
    transport = Transport(rank, [(0, 1), (1, 0)], "rank {}".format, device, timeout)
    # CPU per message and our ring's CPU with nothing else running in the processes, and the backend's
    # allreduce after each rank's own training step; then the time per message and our ring's while a
    # thread of each computes, as a running job's compute does, and our ring once more with nothing running
    idle, cpu = _ping_pong(transport, rank, rounds, device)
    # only a worker with under 2 cores pays its messages' CPU (Setup.shared_cpu)
    after_step = _ping_pong(transport, rank, _computing_rounds(step_s, rounds), device, kernel)[1] \
        if (os.cpu_count() or 1) < 2 * workers else [0.0, 0.0]
    one, allreduce_cpu = _allreduce_at_sync(kernel, step_s, rank, 2 * rounds, device)
    whole = _allreduce_at_sync(kernel, step_s, rank, 2 * rounds, device, allreduce_bytes)[0]
    world = dist.get_world_size()
    allreduce_latency = one / (2 * (world - 1))
    allreduce_per_byte = max(0.0, whole - one) / (2 * (world - 1) / world * allreduce_bytes)
    ring_cpu, ring_cpu_per_byte, plain_s = (0.0, 0.0, 0.0) if ring_cpu_bytes is None else \
        _ring_cpu(device, ring_cpu_bytes)
    alone = {name: _ring_alone(device, codec, codec_bytes) for name, codec in CODECS.items() if codec.lossy} \
        if codec_bytes else {}
    idle_ring = {"none": plain_s, **{name: s for name, (_, s) in alone.items()}} if codec_bytes else {}
    stop = threading.Event()
    load = threading.Thread(target=_run_for, args=(kernel, 0.0, stop), daemon=True)
    load.start()
    latency, per_byte = _line(_ping_pong(transport, rank, rounds, device)[0])
    ring_sizes = _ring_sizes(per_byte)  # rank 0's per_byte sizes it
    ring_latency, ring_per_byte = _ring_line(rank, ring_sizes, device, rounds)
    dist.barrier()  # the other ranks compute until the ring ends: every worker of the job is busy
    stop.set()
    load.join()
    dist.barrier()
    # only pipe-sgd, whose set-up times our ring's CPU, is priced with it
    idle_ring_latency, idle_ring_per_byte = (0.0, 0.0) if ring_cpu_bytes is None else \
        _ring_line(rank, ring_sizes, device, rounds)
    periods = {name: _period(kernel, device, CODECS[name], codec_bytes, s) for name, s in idle_ring.items()} \
        if shared else {}
    if rank != 0:
        return {}
    cpu_s, cpu_per_byte = _line(cpu)
    computing_cpu_s, computing_cpu_per_byte = _line(after_step)
    idle_latency = _line(idle)[0]
    return dict(backend=dist.get_backend(), workers=workers, threads=threads, cores=os.cpu_count() or 1,
                slowdown=max(1.0, slowdown), latency_s=latency, s_per_byte=per_byte, message_cpu_s=cpu_s,
                message_cpu_s_per_byte=cpu_per_byte, copy_s_per_byte=_memory_s_per_byte(device, torch.Tensor.copy_),
                add_s_per_byte=_memory_s_per_byte(device, torch.Tensor.add_),
                ring_latency_s=ring_latency, ring_s_per_byte=ring_per_byte, allreduce_latency_s=allreduce_latency,
                allreduce_s_per_byte=allreduce_per_byte, allreduce_bytes=allreduce_bytes,
                jitter_s=statistics.median(jitters), allreduce_cpu_s=allreduce_cpu, ring_cpu_s=ring_cpu,
                ring_cpu_s_per_byte=ring_cpu_per_byte, idle_latency_s=idle_latency, step_s=step_s,
                step_rows=kernel.rows if isinstance(kernel, ModelStep) else 0,
                codec_ring_cpu_s={name: cpu for name, (cpu, _) in alone.items()}, ring_cpu_bytes=codec_bytes,
                resampled_s=resampled, idle_ring_latency_s=idle_ring_latency, idle_ring_s_per_byte=idle_ring_per_byte,
                idle_ring_s=idle_ring, period_s=periods, computing_message_cpu_s=computing_cpu_s,
                computing_message_cpu_s_per_byte=computing_cpu_per_byte)


def _ping_pong(transport: Any, rank: int, rounds: int, device: torch.device,
               between: Callable[[], Any] | None = None) -> tuple[list[float], list[float]]:
    """(one-way seconds, CPU seconds per message end) at each of :data:`MESSAGE_SIZES`: means of
    ``rounds`` round trips of each between ranks 0 and 1 (other ranks only join the barrier), the sizes
    taken in turn within every round, so that both meet the same states of the machine's scheduler.
    ``between``: run by ranks 0 and 1 before each round trip, its thread's own CPU left out of the
    message's (what the transport and gloo threads did meanwhile is kept), not timed.
    Taken one size after the other, the line's intercept and slope traded errors: within one launch of
    4 workers on 2 cores, 0.7-4.4 ms with 3.35-0.15 ns/B; in turn, 1.1-4.4 ms with 0.0-0.66 ns/B."""
    import torch.distributed as dist

    from pipetrain.runtime.transport import Message

    payloads = [torch.zeros(n // 4, device=device) for n in MESSAGE_SIZES]
    wall, cpu = [0.0] * len(payloads), [0.0] * len(payloads)
    dist.barrier()
    if rank > 1:
        return wall, cpu
    for k in range(rounds):
        for i, payload in enumerate(payloads):
            c0 = time.process_time()
            if between is not None:
                own = time.thread_time()
                between()
                c0 += time.thread_time() - own
            tag, t0 = k * len(payloads) + i, time.perf_counter()
            if rank == 0:
                transport.send(1, Message(tag, None, 0, [payload], False))
                transport.recv(1, tag, None, "the pong")
            else:
                transport.recv(0, tag, None, "the ping")
                transport.send(0, Message(tag, None, 0, [payload], False))
            wall[i] += (time.perf_counter() - t0) / (2 * rounds)
            cpu[i] += (time.process_time() - c0) / (2 * rounds)
    return wall, cpu


COMPUTING_ROUNDS_SECONDS = 2.0
"""About how long the ping-pong after a training step (:func:`_computing_rounds`) may take. A message's
transport and gloo threads that run right after a step find the caches holding the step's data: on
sim_vs_real's wide MLP (2 workers, 2 cores), a 256 KB message end cost 0.6-0.9 ms of CPU after a step
of 64 rows, 0.25-0.3 ms with nothing else running; in its runs each end of gpipe's 256 KB messages
cost 1.0-1.2 ms (the runs' transport and gloo threads over their messages)."""


def _computing_rounds(step_s: float, rounds: int) -> int:
    """Round trips of the ping-pong after a step of ``step_s`` seconds: ``rounds``, fewer where they
    would take over :data:`COMPUTING_ROUNDS_SECONDS`, at least 3."""
    per_round = len(MESSAGE_SIZES) * max(step_s, 1e-9)
    return max(3, min(rounds, int(COMPUTING_ROUNDS_SECONDS / per_round)))


RING_BYTES = (1 << 16, 1 << 20, 1 << 25)
"""Gradient bytes of the small ring allreduce, and the bounds of the large one (:func:`_ring_line`)."""
RING_CPU_MAX_BYTES = 1 << 27
"""The largest gradient :func:`_ring_cpu` allreduces (a larger job's is priced from its line)."""
RING_CPU_SECONDS = 1.0
"""About how long :func:`_ring_alone` times one ring allreduce over (fewer calls on a slow link)."""
RING_CPU_CALLS = (3, 9)
"""The fewest and the most calls :func:`_ring_alone` takes the median of."""
PERIOD_CALLS = (3, 24)
"""The fewest and the most iterations of pipe-sgd's loop :func:`_period` takes the median of: its
iterations vary with the machine's phases, and mnist-mlp's 4 workers on 2 cores read 24.4-32.9 ms for
the plain ring in four set-ups with at most 9, 24.2-31.1 with at most 25 (24-33 ms an iteration in its
runs)."""
RING_SECONDS = 0.1
"""About how long the large ring allreduce should take, judged from the ping-pong's seconds per byte."""


def _ring_sizes(s_per_byte: float) -> tuple[int, int]:
    """The gradient bytes of :func:`_ring_line`'s two allreduces: :data:`RING_BYTES`' small one, and as
    many bytes as rank 0's ``s_per_byte`` moves in :data:`RING_SECONDS`, within its bounds."""
    import torch.distributed as dist

    big = [min(RING_BYTES[2], max(RING_BYTES[1], int(RING_SECONDS / max(s_per_byte, 1e-12))))]
    dist.broadcast_object_list(big, src=0)
    return RING_BYTES[0], big[0]


def _ring_line(rank: int, sizes: tuple[int, int], device: torch.device, rounds: int,
               big_rounds: int = 3) -> tuple[float, float]:
    """(α, β) of :func:`pipetrain.strategies.ring.ring_allreduce` over every rank (all call it, in the
    set-up each first while its compute thread runs, then with nothing else running): the ring
    model's line through two gradient ``sizes`` (:func:`_ring_sizes`). Small: ``rounds``
    staggered allreduces (:func:`_staggered_calls`; with 3, α read 0.3-7.9 ms per step in six probes a
    few seconds apart), each rank's median, waiting included, averaged over the ranks. Lined up by a
    barrier, 4 ranks on 2 cores read 2.8-3.8 ms per step, staggered 3.8-4.4, and mnist-mlp's pipe-sgd
    rings met 3.7-4.1 in its runs (their time less the bytes at β). Large: ``big_rounds`` lined up by
    a barrier, sized to take about :data:`RING_SECONDS` on the link; a one-message line under-rates
    what a long transfer costs (on loopback gloo moved 1 MiB messages at 0.26 ns/B, a 108 MB ring at 1.9 ns/B with
    the cores busy)."""
    import torch.distributed as dist

    from pipetrain.strategies.compression import get_codec
    from pipetrain.strategies.ring import block_size, ring_allreduce

    world = dist.get_world_size()
    small, large = (torch.zeros(world, block_size(n // 4, world, 1), device=device) for n in sizes)
    # the small one staggered, as a job's ranks arrive: each rank's own time, waiting included, is a
    # period of a ring that runs one allreduce after another; the mean over the ranks
    held: dict[str, torch.Tensor] = {}  # as a job's ring keeps its buffers
    small_s = statistics.median(_staggered_calls(lambda: ring_allreduce(small, None, get_codec(None), held), rank,
                                                 rounds)[0])
    times = [_mean_over_ranks(small_s, device),
             median_seconds(lambda: ring_allreduce(large, None, get_codec(None), held), big_rounds, sync=dist.barrier)]
    hops, share = 2 * (world - 1), 2 * (world - 1) / world
    per_byte = max(0.0, times[1] - times[0]) / (share * (sizes[1] - sizes[0]))
    return max(0.0, times[0] - share * sizes[0] * per_byte) / hops, per_byte


def _ring_cpu(device: torch.device, sizes: tuple[int, int]) -> tuple[float, float, float]:
    """(CPU seconds per step, per byte of its block, seconds of the larger ring) of
    :func:`pipetrain.strategies.ring.ring_allreduce` over every rank with nothing else running
    (:func:`_ring_alone`) at two gradient ``sizes`` (bytes): the line of
    :func:`pipetrain.costs.ring_allreduce_cpu_s` through the two, and how long the ``sizes[1]`` one
    took. The line is not straight over all sizes: a block travels in 1 to 16 messages ([Note: chunks] in
    :mod:`pipetrain.strategies.ring`), each 0.27-0.39 ms of CPU from 22 KB to 310 KB and 0.69-0.73 ms at
    1 MB (3 and 4 ranks), so the job's own size is measured when it is known. With a thread of every
    rank computing it is about as much (3 ranks, 3.3 MB: 10.4 ms alone, 9.8 ms beside a matmul loop)."""
    import torch.distributed as dist

    from pipetrain.strategies.ring import block_size

    world, codec = dist.get_world_size(), CODECS["none"]
    block = [block_size(nbytes // 4, world, 1) for nbytes in sizes]  # elements per rank's block
    alone = [_ring_alone(device, codec, nbytes) for nbytes in sizes]
    return (*_line([cpu / (2 * (world - 1)) for cpu, _ in alone], (4 * block[0], 4 * block[1])), alone[1][1])


def _ring_alone(device: torch.device, codec: Codec, nbytes: int) -> tuple[float, float]:
    """(CPU seconds, seconds) of one :func:`pipetrain.strategies.ring.ring_allreduce` of a float32
    gradient of ``nbytes`` with ``codec`` over every rank, nothing else running: calls lined up by a
    barrier after one that warms the ring's buffers up, each rank's median CPU of its whole process
    (gloo's threads included) and median time, each averaged over the ranks. As many calls as fit in
    :data:`RING_CPU_SECONDS` (by the slowest rank's warm-up), between :data:`RING_CPU_CALLS`: one call's CPU varies a lot (vgg-like's
    107 MB ring on 2 ranks: 50-58 ms on one rank and 53-82 ms on the other over 12 calls), and the
    median of 3 read 44-75 ms in four probes."""
    import torch.distributed as dist

    ring = _job_ring(device, codec, nbytes)
    dist.barrier()
    w0 = time.perf_counter()
    ring()
    warm = torch.tensor([time.perf_counter() - w0], dtype=torch.float64, device=device)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    cpu, wall = [], []
    for _ in range(_calls(float(warm), RING_CPU_CALLS)):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        ring()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return _mean_over_ranks(statistics.median(cpu), device), _mean_over_ranks(statistics.median(wall), device)


def _period(kernel: Callable[[], Any], device: torch.device, codec: Codec, nbytes: int, ring_s: float) -> float:
    """Seconds per iteration of pipe-sgd's loop at K = 2 (a collective: every rank calls it): each rank
    runs ``kernel`` (its training step), waits for the ring allreduce of the step before (a float32
    gradient of ``nbytes``, with ``codec``), which ran on a communication thread beside it, and starts
    the next; the median time between the waits' ends, averaged over the ranks. As many iterations as
    rings of ``ring_s`` (the ring alone; the same on every rank) fit in :data:`RING_CPU_SECONDS`, within
    :data:`PERIOD_CALLS`."""
    import torch.distributed as dist

    ring = _job_ring(device, codec, nbytes)
    ends: list[float] = []
    with ThreadPoolExecutor(1) as comm:
        pending = comm.submit(ring)  # warms the buffers up
        kernel()
        pending.result()
        dist.barrier()
        for i in range(_calls(ring_s, PERIOD_CALLS) + 2):
            kernel()
            if i:
                pending.result()
                ends.append(time.perf_counter())
            pending = comm.submit(ring)
        pending.result()
    return _mean_over_ranks(statistics.median(b - a for a, b in zip(ends, ends[1:])), device)


def _job_ring(device: torch.device, codec: Codec, nbytes: int) -> Callable[[], Any]:
    """One :func:`pipetrain.strategies.ring.ring_allreduce` of a float32 gradient of ``nbytes`` with
    ``codec`` over every rank, as a call that keeps its buffers between calls, as a job's ring does."""
    import torch.distributed as dist

    from pipetrain.strategies.ring import block_size, ring_allreduce

    world = dist.get_world_size()
    blocks = torch.zeros(world, block_size(nbytes // 4, world, codec.granule), device=device)
    held: dict[str, torch.Tensor] = {}
    return functools.partial(ring_allreduce, blocks, None, codec, held)


def _calls(each_s: float, bounds: tuple[int, int]) -> int:
    """How many calls of ``each_s`` seconds fit in :data:`RING_CPU_SECONDS`, within ``bounds``."""
    return min(bounds[1], max(bounds[0], int(RING_CPU_SECONDS / max(each_s, 1e-6))))


STAGGER_S = 0.002
"""Up to how long each rank computes, a different time in every round, before it joins an allreduce."""


def _staggered_calls(fn: Callable[[], Any], rank: int, rounds: int,
                     work: Callable[[], Any] | None = None) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of each of ``rounds`` calls of ``fn`` (a collective every rank calls), after two
    untimed: before each, every rank runs ``work`` (if given: a training step) and then computes for a
    different time up to :data:`STAGGER_S`, so the ranks arrive as a job's do, the early ones waiting.
    CPU is the whole process's during the call (the backend's threads included)."""
    import random

    stagger, wall, cpu = random.Random(rank), [], []
    for _ in range(rounds + 2):
        if work is not None:
            work()
        until = time.perf_counter() + stagger.uniform(0.0, STAGGER_S)
        while time.perf_counter() < until:
            pass
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall[2:], cpu[2:]


SYNC_PROBE_S = 1.0
"""About how long :func:`_allreduce_at_sync` may take: its rounds are as many training steps and calls."""


def _allreduce_at_sync(kernel: Callable[[], Any], step_s: float, rank: int, rounds: int,
                       device: torch.device, nbytes: int = 4) -> tuple[float, float]:
    """(seconds, CPU seconds) per call of the backend's ``all_reduce`` of ``nbytes`` (default: 1 element)
    as a job's sync meets it: in each round every rank runs a training step (``kernel``, ``step_s``
    seconds with every rank computing), then computes its own stagger (:func:`_staggered_calls`), then
    calls; its compute waits in the call, as a job's does. Rounds: ``rounds``, fewer where the steps and
    calls would take over :data:`SYNC_PROBE_S` (at least 8). Seconds: each round's time is the last
    caller's (the others were already waiting), the mean over the rounds. CPU: each rank's median,
    averaged over the ranks; waiting for the last rank costs CPU too (2 ranks on 2 cores: 0.16-0.19 ms
    back to back, 0.29-0.44 ms staggered by up to 2 ms).

    Ours: the repository's example MLP (a 73 KB gradient, 2 workers on 2 cores) waited 1.0 ms (median)
    and 1.8 ms (mean) for its replicated stage's allreduce, where the 1-element call's α and the
    measured ring's β priced 0.8 ms; alone, a loop of its training step and that allreduce took 0.23
    (0.53) ms per 1-element call and 0.91 (1.43) ms per gradient.

    4 ranks of mnist-mlp on 2 cores, in 5 probes each: with a thread of every rank computing all
    along, as earlier probes took α, 0.7-1.2 ms per step (means of 40 calls), and mnist-mlp's cgdp
    prediction moved 2x between probes; with nothing else running, 0.24-0.28 ms; as here, 0.27-0.42 (12
    probes). Its cgdp signals met medians of 0.19-0.25 ms per step in a traced run, 0.75 for the
    iteration's last (0.4 on average)."""
    import torch.distributed as dist

    flag = torch.zeros(max(1, nbytes // 4), device=device)
    start = time.perf_counter()
    dist.all_reduce(flag)
    each = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(each, op=dist.ReduceOp.MAX)  # every rank must make as many calls
    count = max(8, min(rounds, int(SYNC_PROBE_S / max(step_s + float(each), 1e-9))))
    wall, cpu = _staggered_calls(lambda: dist.all_reduce(flag), rank, count, kernel)
    last = torch.tensor(wall, dtype=torch.float64, device=device)
    dist.all_reduce(last, op=dist.ReduceOp.MIN)
    return statistics.mean(last.tolist()), _mean_over_ranks(statistics.median(cpu), device)


def _mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of every rank's ``value`` (a collective: every rank calls it)."""
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _line(points: list[float], sizes: tuple[int, int] = MESSAGE_SIZES) -> tuple[float, float]:
    """(intercept at 0 bytes, slope per byte) of the line through ``sizes`` (bytes) and ``points``,
    neither below 0."""
    slope = max(0.0, points[1] - points[0]) / (sizes[1] - sizes[0])
    return max(0.0, points[0] - sizes[0] * slope), slope


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch threads (None: as they are), then set back the count before
    it: what this process times or profiles for the workers is timed as a worker runs it."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1,
                   sync: Callable[[], Any] | None = None) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones; ``sync``
    (e.g. ``torch.cuda.synchronize``) ends each timed call, for work a device runs asynchronously."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _memory_s_per_byte(device: torch.device, op: Callable[[torch.Tensor, torch.Tensor], Any],
                       nbytes: int = 1 << 24) -> float:
    """Seconds per byte of ``op(b, a)`` (``Tensor.copy_``, ``Tensor.add_``) on ``nbytes`` on ``device``
    (median of 5)."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.ones_like(a)
    return median_seconds(lambda: op(b, a), 5, sync=torch.cuda.synchronize if device.type == "cuda" else None) \
        / nbytes
