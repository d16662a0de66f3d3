"""Per-stage checkpoints (PipeDream §4): each worker saves its own state after the last backward of
an epoch, with no global barrier; a resumed job restarts every worker from the newest epoch that all
workers completed.

Files are ``DIR/w{rank}-epoch{e}.pt``, written to a temporary name and renamed, so a crash never leaves
a half-written checkpoint. Each worker keeps its two newest epochs: a worker can be at most one epoch
ahead of another, so the newest common epoch is always on disk.
"""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

KEEP = 2
_NAME = re.compile(r"^w(\d+)-epoch(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that does not match the job being resumed."""


def path(directory: str | os.PathLike, rank: int, epoch: int) -> Path:
    return Path(directory) / f"w{rank}-epoch{epoch}.pt"


def save(directory: str | os.PathLike, rank: int, epoch: int, state: dict[str, Any], keep: int | None = KEEP) -> None:
    """Write ``state`` for (rank, epoch) atomically, then drop this worker's epochs older than its
    ``keep`` newest (None keeps every epoch)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    final = path(directory, rank, epoch)
    tmp = final.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, final)
    if keep is not None:
        for old in sorted(epochs_saved(directory).get(rank, []))[:-keep]:
            path(directory, rank, old).unlink(missing_ok=True)


def epochs_saved(directory: str | os.PathLike) -> dict[int, list[int]]:
    """rank -> the epochs it has checkpoints for."""
    found: dict[int, list[int]] = {}
    if Path(directory).is_dir():
        for f in Path(directory).iterdir():
            m = _NAME.match(f.name)
            if m:
                found.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return found


def latest_common_epoch(directory: str | os.PathLike, world_size: int) -> int | None:
    """The newest epoch every one of ``world_size`` workers saved, or None."""
    saved = epochs_saved(directory)
    common = set.intersection(*(set(saved.get(r, [])) for r in range(world_size)))
    return max(common) if common else None


def load(directory: str | os.PathLike, rank: int, epoch: int, layers: tuple[int, int] | None,
         strategy: str = "pipeline") -> dict[str, Any]:
    """Load (rank, epoch) with ``weights_only=True``; check it was saved by the same strategy and holds
    the same layer range (``None``: the whole model, as data-parallel workers hold it)."""
    state = torch.load(path(directory, rank, epoch), map_location="cpu", weights_only=True, mmap=True)
    saved_by = state.get("strategy", "pipeline")
    if saved_by != strategy:
        raise CheckpointError(f"{path(directory, rank, epoch)} was saved by strategy {saved_by!r}, this job runs "
                              f"{strategy!r}; resume with the same strategy or use a new checkpoint directory")
    saved = None if state["layers"] is None else tuple(state["layers"])
    if saved != (None if layers is None else tuple(layers)):
        raise CheckpointError(f"{path(directory, rank, epoch)} holds layers {saved or 'all'} but this job "
                              f"puts layers {layers or 'all'} on rank {rank}; resume with the same stages or use a new "
                              "checkpoint directory")
    return state


def assemble(model: nn.Module, directory: str | os.PathLike, epoch: int | None = None) -> nn.Module:
    """A copy of ``model`` with the weights every stage saved for ``epoch`` (default: the newest epoch
    all workers completed), e.g. to evaluate or deploy a checkpointed run.

    Raises:
        CheckpointError: no epoch that every worker saved.
    """
    saved = epochs_saved(directory)
    world = max(saved, default=-1) + 1
    epoch = latest_common_epoch(directory, world) if epoch is None else epoch
    if epoch is None or any(epoch not in saved.get(r, []) for r in range(world)):
        raise CheckpointError(f"{directory}: no epoch {'' if epoch is None else epoch} saved by all {world} "
                              "workers; train with checkpoint_dir set (keep_checkpoints=None keeps every epoch)")
    state: dict[str, torch.Tensor] = {}
    for r in range(world):
        state.update(torch.load(path(directory, r, epoch), map_location="cpu", weights_only=True)["model"])
    full = copy.deepcopy(model)
    full.load_state_dict(state)
    return full
