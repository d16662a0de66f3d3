"""Per-worker checkpoints (PipeDream §4), with a checksum and a manifest written last.

Each worker saves its own state after the last update of an epoch, with no global barrier; a resumed
job restarts every worker from the newest epoch that every worker saved completely and intact.

Per worker and epoch there are two files, each written to a temporary name and renamed:

* ``DIR/w{rank}-epoch{e}.pt``: the state (``torch.save``; loaded with ``weights_only=True``);
* ``DIR/w{rank}-epoch{e}.json``: the manifest, written last: the ``.pt``'s size and SHA-256, and the
  identity of the job that saved it (model, strategy, layout, world size).

An epoch counts as saved by a worker only once its manifest exists, and its ``.pt`` is trusted only if
it still has the size and checksum the manifest says. A worker keeps its ``keep`` newest epochs
(default 2: a worker can be at most one epoch ahead of another, so the newest common epoch is always
on disk); it deletes an old epoch's manifest before its state.
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.errors import one_line

KEEP = 2
FORMAT, VERSION = "pipetrain-checkpoint", 1
_NAME = re.compile(r"^w(\d+)-epoch(\d+)\.json$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not belong to the job being resumed."""


def path(directory: str | os.PathLike, rank: int, epoch: int) -> Path:
    """The state file of (rank, epoch)."""
    return Path(directory) / f"w{rank}-epoch{epoch}.pt"


def manifest_path(directory: str | os.PathLike, rank: int, epoch: int) -> Path:
    return Path(directory) / f"w{rank}-epoch{epoch}.json"


def fingerprint(model: nn.Module) -> str:
    """The model's class and every state tensor's name, shape and dtype, hashed: two models with the
    same fingerprint can load each other's weights."""
    h = hashlib.sha256(type(model).__name__.encode())
    for key, t in sorted(model.state_dict().items()):
        h.update(f"{key}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def _atomic_write(target: Path, data: bytes) -> None:
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def save(directory: str | os.PathLike, rank: int, epoch: int, state: dict[str, Any], job: dict[str, Any],
         keep: int | None = KEEP) -> None:
    """Write ``state`` for (rank, epoch), then its manifest (with ``job``, the job's identity), then
    drop this worker's epochs older than its ``keep`` newest (None keeps every epoch)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    _atomic_write(path(directory, rank, epoch), data)
    manifest = {"format": FORMAT, "version": VERSION, "rank": rank, "epoch": epoch,
                "file": path(directory, rank, epoch).name, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "job": job}
    _atomic_write(manifest_path(directory, rank, epoch), json.dumps(manifest).encode())
    if keep is not None:
        for old in sorted(epochs_saved(directory).get(rank, []))[:-keep]:
            manifest_path(directory, rank, old).unlink(missing_ok=True)
            path(directory, rank, old).unlink(missing_ok=True)


def epochs_saved(directory: str | os.PathLike) -> dict[int, list[int]]:
    """rank -> the epochs it finished saving (those with a manifest)."""
    found: dict[int, list[int]] = {}
    if Path(directory).is_dir():
        for f in Path(directory).iterdir():
            m = _NAME.match(f.name)
            if m:
                found.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return found


def _manifest(directory: str | os.PathLike, rank: int, epoch: int) -> dict[str, Any]:
    f = manifest_path(directory, rank, epoch)
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f} cannot be read ({one_line(e)}); delete it or resume from "
                              "another directory") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{f} is not a pipetrain checkpoint manifest; delete it or resume from another directory")
    if data.get("version", 0) > VERSION:
        raise CheckpointError(f"{f} was written by a newer pipetrain (checkpoint version {data['version']}, this one "
                              f"reads {VERSION}); upgrade pipetrain to resume it")
    return data


def damage(directory: str | os.PathLike, rank: int, epoch: int) -> str | None:
    """What is wrong with (rank, epoch)'s state file, or None when it has the manifest's size and checksum."""
    manifest = _manifest(directory, rank, epoch)
    f = path(directory, rank, epoch)
    try:
        data = f.read_bytes()
    except OSError as e:
        return f"{f} cannot be read ({e.strerror or type(e).__name__})"
    if len(data) != manifest["bytes"]:
        return f"{f} is truncated ({len(data):,} of {manifest['bytes']:,} bytes)"
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        return f"{f} is corrupt (its checksum does not match its manifest)"
    return None


def _differs(saved: dict[str, Any], job: dict[str, Any]) -> str | None:
    for key, what in (("model", "model"), ("strategy", "strategy"), ("world", "world size"),
                      ("layout", "plan (stages and replicas)")):
        if saved.get(key) != job.get(key):
            return f"{what}: saved {saved.get(key)}, this job {job.get(key)}"
    return None


def resume_epoch(directory: str | os.PathLike, world: int, job: dict[str, Any],
                 warn: Callable[[str], None]) -> int | None:
    """The newest epoch every one of ``world`` workers saved completely and intact, or None.

    A newer epoch with a truncated or corrupt state file is skipped, with a warning naming the file.

    Raises:
        CheckpointError: the checkpoints belong to another job (the message says what differs), or a
            manifest cannot be read.
    """
    saved = epochs_saved(directory)
    common = set.intersection(*(set(saved.get(r, [])) for r in range(world))) if world else set()
    for epoch in sorted(common, reverse=True):
        for rank in range(world):
            what = _differs(_manifest(directory, rank, epoch)["job"], job)
            if what:
                raise CheckpointError(f"{manifest_path(directory, rank, epoch)} belongs to another job ({what}); "
                                      "resume with the same job or use a new checkpoint directory")
        problems = [p for p in (damage(directory, r, epoch) for r in range(world)) if p]
        if not problems:
            return epoch
        warn(f"{problems[0]}; skipping epoch {epoch}" + (f" and resuming after epoch {epoch - 1} if it is whole"
                                                          if epoch else ""))
    return None


def load(directory: str | os.PathLike, rank: int, epoch: int) -> dict[str, Any]:
    """Load (rank, epoch) with ``weights_only=True``.

    Raises:
        CheckpointError: the file cannot be read as a checkpoint (one line; never advises
            ``weights_only=False``).
    """
    f = path(directory, rank, epoch)
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file; all mean the same here
        raise CheckpointError(f"{f} cannot be read as a checkpoint ({one_line(e, 160)}); it is damaged: "
                              "delete it or resume from another directory") from None


def history(directory: str | os.PathLike, world: int, epoch: int) -> list[dict[str, Any]]:
    """The training history the workers saved with ``epoch`` (every record up to its end), by step."""
    records = [h for r in range(world) for h in load(directory, r, epoch).get("history", [])]
    return sorted(records, key=lambda h: h["step"])


def assemble(model: nn.Module, directory: str | os.PathLike, epoch: int | None = None) -> nn.Module:
    """A copy of ``model`` with the weights every worker saved for ``epoch`` (default: the newest epoch
    all workers completed), e.g. to evaluate or deploy a checkpointed run.

    Raises:
        CheckpointError: no epoch that every worker saved, or a damaged file.
    """
    saved = epochs_saved(directory)
    world = max(saved, default=-1) + 1
    if epoch is None:
        common = set.intersection(*(set(saved.get(r, [])) for r in range(world))) if world else set()
        epoch = max(common) if common else None
    if epoch is None or any(epoch not in saved.get(r, []) for r in range(world)):
        raise CheckpointError(f"{directory}: no epoch {'' if epoch is None else epoch} saved by all {world} "
                              "workers; train with checkpoint_dir set (keep_checkpoints=None keeps every epoch)")
    state: dict[str, torch.Tensor] = {}
    for r in range(world):
        state.update(load(directory, r, epoch)["model"])
    full = copy.deepcopy(model)
    full.load_state_dict(state)
    return full
