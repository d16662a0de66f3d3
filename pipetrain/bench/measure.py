"""What every benchmark runner shares: what it trains (:class:`PeerConfig`), how it times it, and one
job's numbers from its ranks' results.

A runner is one rank of a job, configured like torchrun: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT come from the environment. So the same function runs under
:func:`pipetrain.runtime.launch.spawn` on loopback, under :meth:`EmulatedCluster.spawn` (one rank per
namespace host), or under torchrun (``python -c`` calling it). Each trains a zoo model on synthetic
data and returns plain data (see :func:`timed_windows`):

* ``samples_per_s``: the median over timed windows of the job's samples per second, after warm-up
  steps; ``window_samples_per_s`` holds every window. Windows end with a barrier, so every rank
  reports the same job-wide rate.
* ``counted_bytes_per_sample``: bytes this worker sends per sample of the job, from the tensor sizes
  (see each runner for the formula). ``iface_bytes_per_sample``: the same read from the network
  interface's tx counter, when there is one per worker (``GLOO_SOCKET_IFNAME`` other than ``lo``, as in
  the emulated cluster); None on loopback, where every rank shares ``lo``.

A sample is one sample of the job's minibatch (``batch_size``, the samples of one optimizer update for
the whole job), so data-parallel and pipeline numbers compare directly. The runners:
:mod:`pipetrain.bench.torch_peers` (PyTorch DDP, ``torch.distributed.pipelining``, a parameter
server) and :mod:`pipetrain.bench.pipetrain_jobs` (pipetrain itself).
"""
from __future__ import annotations

import datetime
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.zoo import SPECS, ModelSpec


@dataclass
class PeerConfig:
    """What every peer runner trains and how it times it.

    Attributes:
        model: a :data:`pipetrain.zoo.SPECS` name.
        model_kwargs: the model factory's size knobs.
        batch_size: samples per optimizer update of the whole job (split across data-parallel workers,
            or into microbatches by a pipeline).
        warmup: untimed steps first (allocations, gloo connections, pipelining's shape exchange).
        windows: timed windows; the reported rate is their median.
        steps_per_window: optimizer steps per window.
        lr: SGD learning rate.
        seed: model initialisation and data.
        threads: torch threads per worker.
        timeout_s: how long a collective or p2p operation may wait on a peer.
        iface: network interface whose tx counter is read; default ``GLOO_SOCKET_IFNAME`` unless ``lo``.
    """

    model: str = "vgg-like"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    warmup: int = 2
    windows: int = 3
    steps_per_window: int = 2
    lr: float = 0.01
    seed: int = 0
    threads: int = 1
    timeout_s: float = 300.0
    iface: str | None = None

    def __post_init__(self) -> None:
        if self.model not in SPECS:
            raise ValueError(f"model={self.model!r} is not in the zoo; choose one of {sorted(SPECS)}")
        for name in ("batch_size", "windows", "steps_per_window", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be at least 0")

    @property
    def spec(self) -> ModelSpec:
        return SPECS[self.model]

    def build(self) -> nn.Module:
        """The model, initialised identically on every rank."""
        torch.manual_seed(self.seed)
        return self.spec.factory(**self.model_kwargs)

    def interface(self) -> str | None:
        """The interface whose tx counter is this worker's own (``iface``, else ``GLOO_SOCKET_IFNAME``), or
        None where there is none: unset, or ``lo``, which every rank on one machine shares."""
        iface = self.iface or os.environ.get("GLOO_SOCKET_IFNAME")
        return iface if iface and iface != "lo" else None


def init_group(cfg: PeerConfig) -> tuple[int, int]:
    """Join the job's gloo process group (if not yet) with ``cfg``'s threads and timeout; (rank, world)."""
    torch.set_num_threads(cfg.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
    return dist.get_rank(), dist.get_world_size()


def batches(cfg: PeerConfig, n: int, seed: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few synthetic minibatches to cycle through (made up front: data loading is not measured)."""
    x, y = cfg.spec.dataset(n * count, seed=seed)[:]
    return [(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n]) for i in range(count)]


def timed_windows(cfg: PeerConfig, step: Callable[[int], None], counted_bytes_per_sample: float,
                  params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Warm up, then time ``cfg.windows`` windows of steps, each closed by a barrier.

    Also reports ``update_norm``, how far this worker's ``params`` moved: zero means it never learned.
    """
    before = [p.detach().clone() for p in params]
    i = 0
    for _ in range(cfg.warmup):
        step(i)
        i += 1
    dist.barrier()
    tx0 = _tx_bytes(cfg)
    rates = []
    for _ in range(cfg.windows):
        t0 = time.perf_counter()
        for _ in range(cfg.steps_per_window):
            step(i)
            i += 1
        dist.barrier()
        rates.append(cfg.steps_per_window * cfg.batch_size / (time.perf_counter() - t0))
    tx1 = _tx_bytes(cfg)
    timed_samples = cfg.windows * cfg.steps_per_window * cfg.batch_size
    return {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "model": cfg.model,
        "batch_size": cfg.batch_size, "threads": cfg.threads,
        "samples_per_s": statistics.median(rates), "window_samples_per_s": rates,
        "counted_bytes_per_sample": float(counted_bytes_per_sample),
        "iface_bytes_per_sample": None if tx0 is None or tx1 is None else (tx1 - tx0) / timed_samples,
        "update_norm": float(sum(((p.detach() - b) ** 2).sum() for p, b in zip(params, before)) ** 0.5),
    }


def finish(out: dict[str, Any]) -> dict[str, Any]:
    """Wait for every rank, leave the process group, and return ``out``."""
    dist.barrier()
    dist.destroy_process_group()
    return out


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One job's numbers from its ranks' results: the job rate and per-worker bytes per sample.

    Every rank reports the same job-wide rate; bytes are per rank. What
    :func:`pipetrain.bench.pipetrain_jobs.pipetrain_job` adds about the placement (``stages``,
    ``replicas``, ``plan``, ``predicted_samples_per_s``, ``breakdown``) is the same on every rank and
    passes through.
    """
    first = results[0]
    return {
        "runner": first["runner"], "model": first["model"], "world": first["world"],
        "samples_per_s": first["samples_per_s"], "window_samples_per_s": first["window_samples_per_s"],
        "counted_bytes_per_sample": [r["counted_bytes_per_sample"] for r in results],
        "iface_bytes_per_sample": [r["iface_bytes_per_sample"] for r in results],
        **{k: first[k] for k in ("stages", "replicas", "plan", "predicted_samples_per_s", "breakdown", "ring_s",
                                 "chunks", "search", "weight_versions")
           if k in first},
    }


class TxSampler:
    """A network interface's tx byte counter, read every ``interval_s`` by a thread, with the time.

    Lets a job be measured inside windows that are known only afterwards (pipetrain's history).
    Times are ``time.perf_counter`` (CLOCK_MONOTONIC, shared by every process on one machine).

    The thread shares the machine with the job it measures, which the peers it is compared with do
    not: at a read every 5 ms (opening the counter's file each time) it took 3-4% of a core, the
    compute of 2 workers on 2 cores lost as much, and a pipeline ran 5-10% under its torch twin. So it
    reads rarely, from a file kept open; windows last seconds, and the counter between two reads is
    interpolated.
    """

    def __init__(self, iface: str, interval_s: float = 0.05) -> None:
        self._fd = os.open(_tx_file(iface), os.O_RDONLY)
        self._interval = interval_s
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()
        self._read()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pipetrain-tx-sampler")
        self._thread.start()

    def _read(self) -> None:
        self.samples.append((time.perf_counter(), int(os.pread(self._fd, 32, 0))))

    def _loop(self) -> None:
        while not self._done.wait(self._interval):
            self._read()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._read()
        os.close(self._fd)

    def at(self, t: float) -> float:
        """The counter at time ``t``, interpolated linearly between the samples around it."""
        for (t0, b0), (t1, b1) in zip(self.samples, self.samples[1:]):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else float(b1)
        return float(self.samples[0][1] if t < self.samples[0][0] else self.samples[-1][1])


def _tx_file(iface: str) -> Path:
    return Path("/sys/class/net") / iface / "statistics" / "tx_bytes"


def _tx_bytes(cfg: PeerConfig) -> int | None:
    iface = cfg.interface()
    if iface is None:
        return None
    f = _tx_file(iface)
    return int(f.read_text()) if f.exists() else None
