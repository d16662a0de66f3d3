"""What a worker process holds in memory: its resident bytes now and at their peak, and the baseline a
worker holds before it builds its stage (what the memory prediction adds to its stage's bytes on the CPU,
:mod:`pipetrain.predict.memory`)."""
from __future__ import annotations

import importlib
import os
import resource
from collections.abc import Callable
from typing import Any

import torch

from pipetrain.runtime.launch import spawn, under_torchrun


def peak_resident() -> int:
    """This process's peak resident memory so far, bytes (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident() -> int:
    """This process's resident memory now, bytes (``/proc/self/statm``; the peak where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_resident()


_BASELINES: dict[tuple[Any, ...], int] = {}
"""Baselines measured in this process, by what they depend on: the probe runs once per kind of job."""


def baseline(modules: tuple[str, ...], threads: int, optimizer: Callable[..., torch.optim.Optimizer] | None = None
             ) -> int:
    """The bytes a worker process holds before it builds its stage, on the CPU.

    Measured, not modelled, once per process and kind of job: one process is started as the runtime
    starts its workers (forked from the fork server that has imported torch and pipetrain,
    :func:`pipetrain.runtime.launch.spawn`), imports ``modules`` (where the model's classes live, as a
    worker does when it reads its stage: transformers for a Hugging Face model), sets ``threads``
    torch threads, runs one training step of a small linear layer with ``optimizer``, and reports its
    peak resident memory. The step loads the code of the compute kernels (on a CPU about 80 MB of BLAS
    and torch pages, which a worker loads at its first step whatever its stage). The dataset a worker
    is sent is left out. Under torchrun, where this very process is the worker, its resident memory now."""
    if under_torchrun():
        return resident()
    key = (modules, threads, getattr(optimizer, "func", optimizer))
    if key not in _BASELINES:
        _BASELINES[key] = int(spawn(_held, 1, (modules, threads, optimizer),
                                    describe=lambda rank: "the memory baseline's probe")[0])
    return _BASELINES[key]


def _held(modules: tuple[str, ...], threads: int, optimizer: Callable[..., torch.optim.Optimizer] | None) -> int:
    """In the probe process: its peak resident bytes after importing ``modules`` and one small training step."""
    for name in modules:
        importlib.import_module(name)
    torch.set_num_threads(threads)
    layer = torch.nn.Linear(16, 16)
    layer(torch.ones(4, 16)).sum().backward()
    if optimizer is not None:
        optimizer(list(layer.parameters())).step()
    return peak_resident()


def model_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The Python modules that define ``model``'s module classes (what a worker imports to read its stage)."""
    return tuple(sorted({type(m).__module__ for m in model.modules()}))
