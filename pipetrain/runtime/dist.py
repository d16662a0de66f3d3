"""Joining the job's process group: which backend, this worker's device, and where the workers meet."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain.runtime.launch import loopback_store


BACKENDS = ("auto", "gloo", "nccl")
"""``backend=``: ``auto`` is NCCL where every worker of this machine has a GPU of its own, else gloo
(which lets several workers share one GPU: what gloo cannot move on a GPU is staged through host
memory, :func:`wire_device`)."""


def local_workers(world: int) -> int:
    """The workers on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else every worker of the job."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def check_backend(backend: str, world: int) -> None:
    """One-line ValueError when ``backend`` cannot run ``world`` workers here, before any worker starts."""
    if backend != "nccl":
        return
    gpus, local = torch.cuda.device_count() if torch.cuda.is_available() else 0, local_workers(world)
    if local > gpus:
        raise ValueError(f"backend='nccl' needs a GPU per worker, but {local} workers on this machine would share "
                         f"{gpus} GPU{'s' * (gpus != 1)} (NCCL refuses two ranks on one GPU); use backend='gloo' "
                         "or 'auto'")


def resolve_backend(backend: str, world: int) -> str:
    """The backend ``backend`` means on this machine: ``auto`` is NCCL when every local worker has a GPU."""
    if backend != "auto":
        return backend
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if 0 < local_workers(world) <= gpus else "gloo"


def _device() -> torch.device:
    """This worker's device: a GPU where the machine has one (workers beyond the GPU count share them,
    round robin by local rank), else the CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wire_device(device: torch.device, group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s backend moves tensors of ``device`` point to point: the device itself, except
    that gloo moves only host tensors, so a GPU's go through host memory."""
    return torch.device("cpu") if device.type == "cuda" and dist.get_backend(group) == "gloo" else device


def init_distributed(timeout: float, backend: str = "auto") -> torch.device:
    """Join the job's process group on ``backend`` (:data:`BACKENDS`); return this worker's device.
    Locally launched workers meet on 127.0.0.1 only (:func:`pipetrain.runtime.launch.loopback_store`)."""
    device = _device()
    if dist.is_initialized():
        return device
    rank, world, wait = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timedelta(seconds=timeout)
    backend = resolve_backend(backend, world)
    if os.environ.get("PIPETRAIN_SPAWNED") == "1":
        store = loopback_store(rank, world, int(os.environ["MASTER_PORT"]), timeout)
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # [Note: torchrun restarts] torchrun's default (static) rendezvous hands every restart the same
        # store, where the previous round's addresses would mislead the new round's process group;
        # each round meets under its own prefix
        host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, host, wait)
        store = dist.PrefixStore(f"pipetrain/round{os.environ['TORCHELASTIC_RESTART_COUNT']}", base)
    else:
        dist.init_process_group(backend, timeout=wait)
        return device
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)
    return device
