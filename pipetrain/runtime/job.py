"""What one rank does from start to end: set up, train epoch by epoch, checkpoint, report."""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from pipetrain.layers import LayeredModel
from pipetrain.runtime import checkpoint
from pipetrain.runtime.transport import Transport
from pipetrain.runtime.weights import POLICIES
from pipetrain.runtime.worker import NonFiniteLoss, Worker, epoch_order, per_epoch
from pipetrain.schedule import FLUSH_SCHEDULES, Schedule, build_schedule, warmup
from pipetrain.strategies import ReplicaAllreduce


@dataclass
class JobConfig:
    """Everything every rank needs; validated by ``pipetrain.train`` before any process starts."""

    model: nn.Module
    dataset: Dataset
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer]
    boundaries: list[int]          # first layer of each stage
    replicas: list[int]            # workers per stage
    schedule: str
    vertical_sync: bool
    batch_size: int
    microbatches: int
    epochs: int
    shuffle: bool
    seed: int
    checkpoint_dir: str | None
    resume: bool
    keep_checkpoints: int | None
    timeout: float
    threads: int
    trace: bool
    progress: bool

    def layer_range(self, stage: int, num_layers: int) -> tuple[int, int]:
        ends = [*self.boundaries[1:], num_layers]
        return self.boundaries[stage], ends[stage] - 1

    def policy_name(self) -> str:
        if self.schedule in FLUSH_SCHEDULES:
            return "live"
        if self.schedule == "naive":
            return "naive"
        return "vertical" if self.vertical_sync else "stash"


def describe(replicas: list[int]) -> Callable[[int], str]:
    """rank -> ``"stage s (rank r)"`` (``"stage s replica i (rank r)"`` for replicated stages)."""
    owner = [(s, i) for s, r in enumerate(replicas) for i in range(r)]

    def name(rank: int) -> str:
        s, i = owner[rank]
        return f"stage {s} (rank {rank})" if replicas[s] == 1 else f"stage {s} replica {i} (rank {rank})"
    return name


def edges(replicas: list[int]) -> list[tuple[int, int]]:
    """Every directed worker pair that exchanges activations or gradients."""
    probe = Schedule("edges", tuple(replicas), tuple(() for _ in range(sum(replicas))))
    out = set()
    for s in range(len(replicas) - 1):
        for mb in range(math.lcm(replicas[s], replicas[s + 1])):
            a, b = probe.worker_for(s, mb), probe.worker_for(s + 1, mb)
            out |= {(a, b), (b, a)}
    return sorted(out)


def _device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(timeout: float) -> torch.device:
    """Join the job's process group (NCCL when this worker has a GPU, else gloo); return the device."""
    device, backend = _device()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return device


def run_rank(cfg: JobConfig) -> dict[str, Any]:
    """Train this rank's stage; return its state, history (output stage) and trace, as plain data."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = init_distributed(cfg.timeout)
    result = _train(cfg, rank, world, device)
    # only after success: teardown with a dead peer can block, and on failure the launcher
    # (ours or torchrun) stops every process anyway
    if os.environ.get("PIPETRAIN_SPAWNED") != "1":
        dist.destroy_process_group()
    return result


def _train(cfg: JobConfig, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    layers = LayeredModel(cfg.model)
    probe = Schedule("probe", tuple(cfg.replicas), tuple(() for _ in range(world)))
    stage_idx = probe.stage_of(rank)
    span = cfg.layer_range(stage_idx, len(layers))
    stage = layers.stage(*span).to(device)
    params = [p for p in stage.parameters() if p.requires_grad]
    optimizer = cfg.optimizer(params) if params else None
    start, version = 0, 0
    if cfg.resume and cfg.checkpoint_dir:
        done = checkpoint.latest_common_epoch(cfg.checkpoint_dir, world)
        if done is not None:
            state = checkpoint.load(cfg.checkpoint_dir, rank, done, span)
            stage.load_state_dict(state["model"])
            if optimizer is not None:
                optimizer.load_state_dict(state["optimizer"])
            start, version = done + 1, state["version"]
    name = cfg.policy_name()
    if name == "stash" and warmup(cfg.replicas, stage_idx) == 1:
        name = "live"  # one minibatch in flight: no update between its forward and backward
    policy = POLICIES[name](stage)
    policy.version = version
    transport = Transport(rank, edges(cfg.replicas), describe(cfg.replicas), device, cfg.timeout)
    # every rank makes every replicated stage's group, in stage order, as new_group requires
    groups = {s: dist.new_group(list(range(probe.first_worker(s), probe.first_worker(s) + r)))
              for s, r in enumerate(cfg.replicas) if r > 1}
    sync = ReplicaAllreduce(groups[stage_idx], cfg.replicas[stage_idx]) if stage_idx in groups else None
    worker = Worker(rank, stage, policy, optimizer, transport, cfg.dataset, cfg.loss_fn, cfg.batch_size,
                    device, grad_sync=sync, trace=[] if cfg.trace else None)

    n_items = len(cfg.dataset)  # type: ignore[arg-type]
    lcm = math.lcm(*cfg.replicas)
    k = per_epoch(n_items, cfg.batch_size, lcm)
    bar = _progress(cfg, rank, world, (cfg.epochs - start) * k)
    on_step = (lambda rec: bar.update(1) or bar.set_postfix(loss=f"{rec.loss:.4f}")) if bar else None
    for epoch in range(start, cfg.epochs):
        batches = epoch_order(n_items, cfg.batch_size, epoch, cfg.shuffle, cfg.seed, lcm)
        schedule = build_schedule(cfg.schedule, cfg.replicas, len(batches), cfg.microbatches)
        try:
            worker.run_epoch(schedule, epoch, batches, epoch * k, on_step)
        except NonFiniteLoss as e:
            kept = checkpoint.latest_common_epoch(cfg.checkpoint_dir, world) if cfg.checkpoint_dir else None
            where = f"the checkpoint of epoch {kept} in {cfg.checkpoint_dir} is kept" if kept is not None \
                else "no checkpoint was saved"
            raise NonFiniteLoss(f"{e}; training stopped, {where}; lower the learning rate") from None
        if cfg.checkpoint_dir:
            checkpoint.save(cfg.checkpoint_dir, rank, epoch, {
                "model": stage.state_dict(), "optimizer": optimizer.state_dict() if optimizer else {},
                "epoch": epoch, "version": policy.version, "layers": list(span)}, keep=cfg.keep_checkpoints)
    if bar:
        bar.close()
    transport.close()
    result = {"rank": rank, "state": {k: v.detach().cpu() for k, v in stage.state_dict().items()},
              "history": [asdict(h) for h in worker.history], "trace": worker.trace or [],
              "bytes_sent": transport.bytes_sent + (sync.bytes_sent if sync else 0)}
    if os.environ.get("PIPETRAIN_SPAWNED") != "1":  # torchrun: every rank gets every rank's part
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, result)
        return {"parts": parts}
    return result


def _progress(cfg: JobConfig, rank: int, world: int, total: int):
    if not cfg.progress or rank != world - 1:
        return None
    import threading

    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock leaks on a hard exit
    return tqdm(total=total, desc="pipetrain", unit="mb", dynamic_ncols=True)
