"""The systems ``pipetrain bench`` compares, and one side-by-side run's configuration.

Every system trains the same zoo model on the same synthetic data, at the same minibatch size (the
samples of one optimizer update), on the same workers (one per emulated host, one torch thread each)
and the same link; each is a fresh job. ``ps-sync`` adds its parameter server on one more host, so
when it runs the cluster has ``workers + 1`` hosts and every other system uses the first
``workers``. The systems (the keys of every per-system map in the report):

==================  ===============================================================================
``pipedream``       pipetrain, PipeDream's 1F1B with weight stashing, on the automatic plan
                    (``stages="auto"``: rank 0 profiles and plans for the workers at the link's rate)
``1f1b-flush``      pipetrain, 1F1B over a minibatch's microbatches, then one update (PipeDream-Flush)
``gpipe``           pipetrain, all forwards then all backwards of the microbatches, then one update
``model-parallel``  pipetrain, one minibatch in the pipeline at a time
``ddp``             ``DistributedDataParallel``, BSP over gloo (each worker takes batch / workers)
``zero-bubble``     pipetrain, ZB-H1: 1F1B with each backward split into its input and weight gradients
``2bw``             pipetrain, PipeDream-2BW: 1F1B over every microbatch without a flush, two weight
                    versions per stage
``interleaved-1f1b``  pipetrain, two stages per worker (stage s on worker s mod W), 1F1B over the
                    microbatches, then one update; on the split of the stages' planner for 2W workers
``torch-1f1b``      ``torch.distributed.pipelining.Schedule1F1B``
``torch-gpipe``     ``torch.distributed.pipelining.ScheduleGPipe``
``torch-zero-bubble``  ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB1P: zero bubble's ZB-H1)
``torch-interleaved-1f1b``  ``ScheduleInterleaved1F1B`` on the same 2W stages as ``interleaved-1f1b``
``pipe-sgd``        pipetrain's Pipe-SGD (K = 2); ``pipe-sgd-trunc16`` and ``pipe-sgd-quant8`` with
                    that codec inside its ring allreduce
``pipe-sgd-k1``     only when named: ``pipe-sgd`` at K = 1 (each gradient waited for at once), the
                    baseline of what K = 2 hides
``ddp-fp16``        only when named: ``ddp`` with gradients compressed to fp16 (``fp16_compress_hook``)
``ps-sync``         only when named: synchronous SGD through a parameter server (Pipe-SGD §4's
                    PS-Sync; each worker takes batch / workers, the server is the extra host)
``cgdp``            only when named: pipetrain's CPU-GPU data parallel training with the run-time
                    chunk search, timed after the search
==================  ===============================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipetrain.bench.measure import PeerConfig

PIPE_SGD = {"pipe-sgd": None, "pipe-sgd-trunc16": "trunc16", "pipe-sgd-quant8": "quant8"}
"""pipetrain's Pipe-SGD (K = 2) with each codec inside its ring allreduce."""
SYSTEMS = ("pipedream", "1f1b-flush", "gpipe", "model-parallel", "zero-bubble", "2bw", "interleaved-1f1b", "ddp",
           "torch-1f1b", "torch-gpipe", "torch-zero-bubble", "torch-interleaved-1f1b", *PIPE_SGD)
EXTRA_SYSTEMS = ("pipe-sgd-k1", "ddp-fp16", "ps-sync", "cgdp")
"""Run only when named in ``systems``: Pipe-SGD at K = 1; DDP with ``fp16_compress_hook``; a parameter server; pipetrain's
CGDP (a one-machine method: run it with ``--loopback``; on the emulated cluster each host is a machine
of one worker and the hosts add their sums hierarchically)."""
MICROBATCHED = ("1f1b-flush", "gpipe", "zero-bubble", "2bw", "interleaved-1f1b", "torch-1f1b", "torch-gpipe",
                "torch-zero-bubble", "torch-interleaved-1f1b")
ONE_F_ONE_B = ("1f1b-flush", "2bw", "torch-1f1b", "torch-zero-bubble", "torch-interleaved-1f1b")
"""Need at least one microbatch per worker."""
LOOPED = ("interleaved-1f1b", "torch-interleaved-1f1b")
"""Run on :data:`pipetrain.planning.schedules.STAGES_PER_WORKER` stages per worker, placed round robin."""
TWINS = {"1f1b-flush": "torch-1f1b", "gpipe": "torch-gpipe", "zero-bubble": "torch-zero-bubble",
         "interleaved-1f1b": "torch-interleaved-1f1b"}
"""Each pipetrain schedule and torch's schedule of the same order, on the same stages."""
AUTO_SYSTEM = {"pipeline": "pipedream"}
"""The system that measures a ``strategy="auto"`` candidate, where its name differs."""


@dataclass
class SuiteConfig:
    """One side-by-side run.

    Attributes:
        model, model_kwargs: a :data:`pipetrain.zoo.SPECS` name and its size knobs.
        workers: one per emulated host (or local process on loopback); ``ps-sync`` adds its server.
        link: each host's rate (``1gbit``; ``10mbps`` is megabytes/s, as in tc: see
            :func:`pipetrain.planning.parse_bandwidth`); also the bandwidth the automatic plan assumes.
        loopback: local processes on 127.0.0.1 instead of an emulated cluster (the link is not enforced).
        batch_size: samples per optimizer update, for every system.
        stages: the split for every pipeline, ``pipedream`` included; None: see :mod:`pipetrain.bench.suite`.
        microbatches: counts tried for the microbatched systems.
        systems: which to run, of :data:`SYSTEMS` and :data:`EXTRA_SYSTEMS`.
        warmup, windows, steps_per_window: as in :class:`PeerConfig`.
        threads: torch threads per worker, and for the stage measurements.
        bound_repeats: timed runs per stage for the bound (the median is kept).
        timeout_s: per collective or p2p wait; a job gets three times this in all.
        auto: also let ``strategy="auto"`` choose from a profile taken here and a run set-up measured on
            the same hosts, at the link's measured rate (:func:`pipetrain.bench.predictions.choose_auto`):
            ``pipedream`` then runs the plan it priced, and the report's ``auto`` holds the pick beside
            what every system measured.
    """

    model: str = "vgg-like"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    workers: int = 2
    link: str = "1gbit"
    loopback: bool = False
    batch_size: int = 32
    stages: list[int] | None = None
    microbatches: tuple[int, ...] = (1, 2, 4)
    systems: tuple[str, ...] = SYSTEMS
    warmup: int = 3
    windows: int = 5
    steps_per_window: int = 3
    threads: int = 1
    bound_repeats: int = 10
    timeout_s: float = 300.0
    auto: bool = False

    def __post_init__(self) -> None:
        bad = [s for s in self.systems if s not in SYSTEMS + EXTRA_SYSTEMS]
        if bad:
            raise ValueError(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
        if self.workers < 2:
            raise ValueError(f"workers={self.workers}: a side-by-side run needs at least 2 workers")
        if not self.microbatches or any(m < 1 for m in self.microbatches):
            raise ValueError(f"microbatches={self.microbatches} must be positive counts")
        if self.stages is not None and len(self.stages) != self.workers:
            raise ValueError(f"stages={self.stages} has {len(self.stages)} stages for {self.workers} workers; "
                             "one worker per stage")
        self.peer()  # validates model, batch size and timing counts

    @property
    def hosts(self) -> int:
        """Hosts (or local processes) the run needs: the workers, plus ``ps-sync``'s parameter server."""
        return self.workers + 1 if "ps-sync" in self.systems else self.workers

    def peer(self) -> PeerConfig:
        return PeerConfig(model=self.model, model_kwargs=self.model_kwargs, batch_size=self.batch_size,
                          warmup=self.warmup, windows=self.windows, steps_per_window=self.steps_per_window,
                          threads=self.threads, timeout_s=self.timeout_s)


QUICK = {"warmup": 2, "windows": 3, "steps_per_window": 2, "bound_repeats": 5}
"""``--quick``: fewer and shorter windows (about 4 minutes for vgg-like on a 2-core machine)."""


def microbatch_counts(system: str, cfg: SuiteConfig, n_workers: int) -> list[int]:
    """Microbatch counts ``system`` runs at: every asked count that splits the batch (and, for 1F1B,
    gives each worker one)."""
    if system not in MICROBATCHED:
        return [1]
    ok = [m for m in cfg.microbatches if cfg.batch_size % m == 0 and (system not in ONE_F_ONE_B or m >= n_workers)]
    if not ok:
        raise ValueError(f"{system}: none of microbatches={list(cfg.microbatches)} divides batch_size="
                         f"{cfg.batch_size}{' and is at least the worker count' if system in ONE_F_ONE_B else ''}")
    return ok
