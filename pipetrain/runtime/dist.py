"""Joining the job's process group: this worker's device and backend, and where the workers meet."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain.runtime.launch import loopback_store


def _device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(timeout: float) -> torch.device:
    """Join the job's process group (NCCL when this worker has a GPU, else gloo); return the device.
    Locally launched workers meet on 127.0.0.1 only (:func:`pipetrain.runtime.launch.loopback_store`)."""
    device, backend = _device()
    if dist.is_initialized():
        return device
    rank, world, wait = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timedelta(seconds=timeout)
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
