"""What the suite predicts beside its runs, from inputs measured apart from them: the model profiled
in this process, ``strategy="auto"``'s choice, and each data-parallel system's samples/s."""
from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch

from pipetrain.bench.measure import PeerConfig
from pipetrain.bench.pipetrain_jobs import ring_cost
from pipetrain.bench.systems import AUTO_SYSTEM, PIPE_SGD, SuiteConfig
from pipetrain.planning.choose import CANDIDATES, Choice, choose_strategy
from pipetrain.profiling import Profile, profile_model, time_batching
from pipetrain.setup import Launcher, measure_setup, model_step
from pipetrain.timing import torch_threads
from pipetrain.predict import predict_data_parallel
from pipetrain.simulate import Link
from pipetrain.strategies.kinds import DDP, PipeSGD


def profile_here(cfg: SuiteConfig, peer: PeerConfig, batch: int,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None) -> Profile:
    """The model's per-layer profile on ``batch`` samples of the first minibatch, with the workers'
    thread count (and ``optimizer``'s step per layer, if given)."""
    with torch_threads(cfg.threads):
        x, y = peer.spec.dataset(batch, seed=peer.seed + 1)[:]
        return profile_model(peer.build(), (x, y), peer.spec.loss_fn, optimizer=optimizer, repeats=5, warmup=2)


def profile_with_setup(cfg: SuiteConfig, peer: PeerConfig, launch: Launcher, step_rows: int,
                       ring_cpu: bool = True) -> Profile:
    """The inputs ``stages="auto"`` and ``strategy="auto"`` predict from when they start: the model
    profiled here on the first minibatch (the workers' thread count and SGD), building that minibatch
    from the dataset timed (:func:`pipetrain.profiling.time_batching`), and the run set-up measured on
    the same hosts (:func:`pipetrain.setup.measure_setup`, a training step of ``step_rows`` samples as
    the workers' shared work: a data-parallel worker's shard, a pipeline worker's minibatch)."""
    profile = profile_here(cfg, peer, cfg.batch_size, optimizer=functools.partial(torch.optim.SGD, lr=peer.lr))
    data = peer.spec.dataset(cfg.batch_size, seed=peer.seed + 1)
    with torch_threads(cfg.threads):  # as pipetrain's workers build their minibatches from the dataset
        profile.inputs_s, profile.targets_s, profile.both_s = time_batching(data, cfg.batch_size)
    rows = peer.spec.dataset(step_rows, seed=peer.seed + 1)[:]
    profile.setup = measure_setup(cfg.workers, cfg.threads, model_step(peer.build(), tuple(rows), peer.spec.loss_fn),
                                  launch=launch, ring_bytes=profile.parameter_bytes, ring_cpu=ring_cpu)
    return profile


def choose_auto(cfg: SuiteConfig, peer: PeerConfig, launch: Launcher, link_bps: float | None,
                log: Callable[[str], None]) -> Choice:
    """What ``strategy="auto"`` picks for this run, from the inputs it has when it starts: the model
    profiled here on the first minibatch (the workers' thread count and SGD), building that minibatch
    from the dataset timed (:func:`pipetrain.profiling.time_batching`), the run set-up measured on
    the same hosts (:func:`profile_with_setup`, one training step of a worker's shard as the shared
    work) and the link at its measured rate (one machine on loopback); the pipeline on every host, as
    its run takes them all. Every candidate a run
    system measures is predicted, codecs included (``allow_compression``)."""
    profile = profile_with_setup(cfg, peer, launch, cfg.batch_size // cfg.workers)
    log(f"auto: set-up {profile.setup.describe() if profile.setup else None}")
    names = [n for n in CANDIDATES if AUTO_SYSTEM.get(n, n) in cfg.systems]
    choice = choose_strategy(profile, cfg.workers, None if link_bps is None else link_bps / 8,
                             batch_size=cfg.batch_size, one_machine=link_bps is None, allow_compression=True,
                             strategies=names, every_worker=True)
    log(f"auto:\n{choice.table()}\n{choice.reason}")
    return choice


def predict_systems(cfg: SuiteConfig, peer: PeerConfig, runs: dict[str, dict[int, dict[str, Any]]], update_s: float,
                    link_bps: float, launch: Launcher) -> dict[str, dict[str, Any]]:
    """Each data-parallel system's samples/s predicted by :func:`pipetrain.predict.predict_data_parallel`
    beside what it measured, from inputs measured apart from the runs: one worker's forward + backward
    profiled here on its shard (batch / workers, the workers' thread count), the SGD step alone, the
    link at the measured TCP payload rate, the codec's arithmetic timed here, and the CPU one ring
    allreduce costs a worker and the latency of one hop (:func:`pipetrain.bench.pipetrain_jobs.ring_cost`,
    on the same hosts; the CPU counts when workers have under 2 cores each, as the emulated hosts share
    this machine's); ddp as synchronous SGD (eq. 2)."""
    profile = profile_here(cfg, peer, cfg.batch_size // cfg.workers)
    cores = (os.cpu_count() or 1) / cfg.workers
    rings = {s: launch(ring_cost, (peer, codec), cfg.workers) for s, codec in PIPE_SGD.items() if s in runs}
    comm_cpu = {s: statistics.mean(r["cpu_s"] for r in ranks) for s, ranks in rings.items()}
    latency = statistics.median(r["latency_s"] for ranks in rings.values() for r in ranks) if rings else 0.0
    systems = {"ddp": DDP(), **{s: PipeSGD(staleness=2, compression=codec) for s, codec in PIPE_SGD.items()}}
    out = {}
    with torch_threads(cfg.threads):  # the codec's arithmetic is timed as a worker runs it
        preds = {system: predict_data_parallel(profile, cfg.workers, Link(link_bps / 8, latency),
                                               batch_size=cfg.batch_size, **strategy.prediction_flags(),
                                               update_s=update_s, comm_cpu_s=comm_cpu.get(system, 0.0),
                                               cores_per_worker=cores)
                 for system, strategy in systems.items() if system in runs}
    for system, pred in preds.items():
        measured = runs[system][1]["samples_per_s"]
        out[system] = {"predicted_samples_per_s": pred.samples_per_s, "measured_samples_per_s": measured,
                       "error": pred.samples_per_s / measured - 1, "measured_ring_s": runs[system][1].get("ring_s"),
                       "comm_cpu_s": comm_cpu.get(system), "cores_per_worker": cores, "latency_s": latency,
                       **{k: v for k, v in pred.to_dict().items() if k != "busy_fraction"}}
    return out
