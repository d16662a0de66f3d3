"""The run set-up a profile is taken for, as data: what a message costs and how workers that share
cores slow each other, measured by :func:`pipetrain.setup.measure_setup`.

The simulator, the planner and the data-parallel predictions read it through the methods here and
:mod:`pipetrain.costs`; a profile saves it as JSON (:meth:`Setup.from_dict`, ``dataclasses.asdict``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from pipetrain import costs


@dataclass(frozen=True)
class Setup:
    """How a job's workers run, measured on the machine (see :func:`pipetrain.setup.measure_setup`).

    Attributes:
        backend: ``gloo`` or ``nccl``.
        workers: worker processes sharing this machine when measured.
        threads: torch threads per worker.
        cores: the machine's cores (``os.cpu_count()``).
        slowdown: mean compute time per step with all ``workers`` computing at once, over the same
            alone (1: no contention; 2: four single-thread workers on two cores).
        latency_s, s_per_byte: one message's one-way time between two workers while every worker computes,
            as a line through two sizes (:data:`pipetrain.setup.messages.MESSAGE_SIZES`).
        idle_latency_s: the same line's latency with nothing else running in the two processes; 0 when
            not measured (a message then always takes ``latency_s``: see
            :func:`pipetrain.costs.busy_latency_s`).
        message_cpu_s, message_cpu_s_per_byte: CPU seconds a message costs one end (all the threads of
            the process: transport, gloo) with nothing else running in the process, as a line through
            the same sizes.
        computing_message_cpu_s, computing_message_cpu_s_per_byte: the same for a message sent or
            received right after a training step, as a job's workers send theirs (the step's own CPU
            left out); 0 when not measured, and the idle line stands in. A job's messages pay this one
            (:meth:`shared_cpu`): see :data:`pipetrain.setup.messages.COMPUTING_ROUNDS_SECONDS`.
        copy_s_per_byte: copying memory (a stashed weight version, a gradient buffer).
        ring_latency_s, ring_s_per_byte: our ring allreduce over all the workers while every worker
            computes (α and β of :func:`pipetrain.costs.ring_allreduce_time`: n bytes over p workers take
            2(p-1) α + 2(p-1)/p n β), from two sizes (:func:`pipetrain.setup.ring.ring_line`); 0 when not measured (a
            profile saved without them), and the message figures stand in.
        idle_ring_latency_s, idle_ring_s_per_byte: the same ring's line with nothing else running (what
            a ring met while the workers compute only part of it is priced between the two:
            :func:`pipetrain.costs.overlapped_ring_s`); 0 when not measured (a pipeline's set-up, which
            leaves our ring's CPU unmeasured too), and the ring is priced busy.
        idle_ring_s: seconds one whole ring allreduce of a gradient of ``ring_cpu_bytes`` took with each
            codec (by name, ``none`` included), nothing else running, timed with its CPU
            (:func:`pipetrain.setup.ring.ring_alone`): the job's own ring, its codec's work included, where the idle line
            holds neither (see :meth:`idle_ring`); empty when not measured.
        allreduce_latency_s: α of the backend's own allreduce (what DDP, a replicated stage's buckets
            and CGDP's signals use): a 1-element ``all_reduce`` among all the workers arriving
            staggered, from the last rank's call, over its 2(p-1) steps
            (:func:`pipetrain.setup.collectives.allreduce_at_sync`); 0 when not measured.
        allreduce_s_per_byte, allreduce_bytes: β of the same allreduce, from the same probe of a
            gradient of ``allreduce_bytes`` (the job's, at most a replicated stage's bucket) beside the
            1-element one (the line through the two: 2(p-1) α + 2(p-1)/p n β), for gradients up to that
            size (:meth:`allreduce_terms`); 0 when not measured (the measured ring's β stands in).
        jitter_s: how much a worker's compute time varies with all ``workers`` computing at once, as a
            variance per second of compute: work of d seconds takes d ± sqrt(``jitter_s`` d) (one
            standard deviation; :func:`pipetrain.setup.compute.jitter_of_calls`); 0 when not measured.
        allreduce_cpu_s: CPU seconds a worker spends in one 1-element ``all_reduce`` of the backend (a
            signal: CGDP sends two per chunk), waiting for the others included; 0 when not measured.
        ring_cpu_s, ring_cpu_s_per_byte: CPU seconds a rank spends in one step of our ring allreduce,
            fixed and per byte of its block (:func:`pipetrain.costs.ring_allreduce_cpu_s`), with nothing
            else running (:func:`pipetrain.setup.ring.ring_cpu_line`); 0 when not measured, and the message figures stand in.
        codec_ring_cpu_s, ring_cpu_bytes: CPU seconds a rank spends in one whole ring allreduce of a
            gradient of ``ring_cpu_bytes`` with each lossy codec (by name), with nothing else running,
            as the plain ring's CPU is measured; empty and 0 when not measured (the plain ring's line and
            the codec's arithmetic timed apart stand in: see :meth:`codec_ring_cpu`).
        add_s_per_byte: adding memory into memory of the same size, per byte of one of them (a
            microbatch's gradients added into ``.grad``); 0 when not measured.
        step_s, step_rows: the seconds one call of the measured kernel took with all ``workers`` calling
            it at once (the median over the rounds of their mean), and, when the kernel was a training
            step of the model (:func:`pipetrain.setup.model_step`), the rows of its batch; 0 when not measured or not a
            model step. A step at a data-parallel worker's shard prices that worker's forward and
            backward directly (:func:`pipetrain.predict.predict_data_parallel`).
        period_s: where the workers share cores, seconds per iteration of pipe-sgd's own loop at K = 2
            with each codec (by name, ``none`` included) at a gradient of ``ring_cpu_bytes``: the
            kernel, then the ring of the step before it, which ran beside it
            (:func:`pipetrain.setup.ring.pipe_sgd_period`; see :meth:`period`); empty when not measured.
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

        [Note: backend β] A large gradient priced at the backend's β at sync over-predicts DDP, by 21%
        on vgg-like with 2 workers, where the busy ring's β does not
        (``python benchmarks/dp_predictions.py --models vgg-like``)."""
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

        Measured rather than derived: the plain ring's line at the payload's bytes plus the codec's
        arithmetic timed apart prices a codec's ring short, as a block travels in several chunks whose
        fixed cost does not shrink with the bytes, and the codec's arithmetic runs per chunk, slower
        than on the whole gradient at once."""
        return self._at_job(self.codec_ring_cpu_s, codec, workers, nbytes)

    def idle_ring(self, codec: str, workers: int, nbytes: int) -> float | None:
        """Seconds our ring allreduce of ``nbytes`` of gradient over ``workers`` with ``codec`` took with
        nothing else running, as measured in this set-up; None where it was not measured for that codec,
        those workers and that size.

        Measured rather than derived: where workers share cores, the idle line (α, β) and the codec's
        arithmetic timed apart price a codec's ring, a fraction of the bytes, shorter than it runs."""
        return self._at_job(self.idle_ring_s, codec, workers, nbytes)

    def period(self, codec: str, workers: int, nbytes: int) -> float | None:
        """Seconds per iteration of pipe-sgd's loop at K = 2 (a training step, the ring of the step before
        beside it) over ``workers`` with ``codec`` at ``nbytes`` of gradient, as measured in this set-up;
        None where it was not (workers with cores of their own, another codec, workers or size).

        Measured rather than derived: where workers share cores, the ring's CPU and the compute slow
        each other by more than either's own measurement says, whether the ring's CPU is charged at the
        workers per core or at the compute's slowdown (which also varies from one set-up to the next)."""
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
        (:func:`pipetrain.jsonfile.read_field`); ValueError naming the field otherwise. Keys that are no
        field of :class:`Setup` are ignored, so a profile written by another version of pipetrain loads."""
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
                + (f", a training step of {self.step_rows} rows {1e3 * self.step_s:.1f} ms all at once" if self.step_rows else ""))
