"""Per-worker checkpoints (PipeDream §4), with a checksum and a manifest written last.

Each worker saves its own state after the last update of an epoch, with no global barrier; a resumed
job restarts every worker from the newest epoch that every worker of the saving job saved completely
and intact.

Per saving worker and epoch there are two files, each written to a temporary name and renamed:

* ``DIR/w{rank}-epoch{e}.pt``: the state (``torch.save``; loaded with ``weights_only=True``): the
  stage's ``"model"`` state and its ``"optimizer"`` state, both keyed by the model's own names
  (:func:`pipetrain.runtime.restore.named_state`), the learning-rate ``"scheduler"``, the weight
  ``"version"``, the ``"rng"`` state and the ``"history"`` it recorded;
* ``DIR/w{rank}-epoch{e}.json``: the manifest, written last: the ``.pt``'s size and SHA-256, the
  identity of the job that saved it (model, strategy, layout, world size, and how many files it saves
  per epoch: ``savers``), and what the ``.pt`` holds (``holds``: its model tensors' names, its
  optimized parameters' names, its history's length), so a worker of another layout finds the files
  holding its names without opening the others (:mod:`pipetrain.runtime.restore`).

An epoch counts as saved by a worker only once its manifest exists, and its ``.pt`` is trusted only if
it still has the size and checksum the manifest says. An epoch is whole when worker 0's manifest and
those of every other saver of its job (``savers``, from that manifest) exist; files of other jobs
left in the directory (a job resumed on fewer workers leaves the old higher ranks' files) are not
part of it. A worker keeps its ``keep`` newest epochs (default 2: a worker can be at most one epoch
ahead of another, so the newest whole epoch is always on disk); it deletes an old epoch's manifest
before its state.
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
FORMAT, VERSION = "pipetrain-checkpoint", 2
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
    """Write ``state`` for (rank, epoch), then its manifest (with ``job``, the job's identity, and the
    names ``state`` holds), then drop this worker's epochs older than its ``keep`` newest (None keeps
    every epoch)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    _atomic_write(path(directory, rank, epoch), data)
    holds = {"model": list(state["model"]),
             "optimizer": [n for g in state["optimizer"].get("param_groups", []) for n in g["params"]],
             "history": len(state["history"])}
    manifest = {"format": FORMAT, "version": VERSION, "rank": rank, "epoch": epoch,
                "file": path(directory, rank, epoch).name, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "job": job, "holds": holds}
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
    if data.get("version", 0) < VERSION:
        raise CheckpointError(f"{f} was written by an older pipetrain (checkpoint version {data.get('version')}, "
                              f"optimizer state by position; this one reads {VERSION}); resume it with that "
                              "pipetrain, or train into a new checkpoint directory")
    return data


def whole(directory: str | os.PathLike, epoch: int,
          saved: dict[int, list[int]] | None = None) -> list[dict[str, Any]] | None:
    """The manifests of every saver of the job that saved ``epoch``, by rank, or None where one is
    missing. The job is worker 0's (every job has one); a file another job left at a rank is not
    part of it. ``saved``: :func:`epochs_saved`, if the caller has it."""
    saved = epochs_saved(directory) if saved is None else saved
    if epoch not in saved.get(0, []):
        return None
    first = _manifest(directory, 0, epoch)
    manifests = [first]
    for rank in range(1, first["job"]["savers"]):
        if epoch not in saved.get(rank, []):
            return None
        manifest = _manifest(directory, rank, epoch)
        if manifest["job"] != first["job"]:
            return None
        manifests.append(manifest)
    return manifests


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


def resume_epoch(directory: str | os.PathLike, job: dict[str, Any], warn: Callable[[str], None]) -> int | None:
    """The newest epoch that every saver of the job that saved it saved completely and intact, or None.

    That job may have had another strategy, layout or world size than ``job`` (its workers' files
    are read by name, :mod:`pipetrain.runtime.restore`); it must have trained the same model. A newer
    epoch with a truncated or corrupt state file is skipped, with a warning naming the file.

    Raises:
        CheckpointError: the checkpoints are of another model, or a manifest cannot be read.
    """
    saved = epochs_saved(directory)
    for epoch in sorted(set(saved.get(0, [])), reverse=True):
        manifests = whole(directory, epoch, saved)
        if manifests is None:
            continue
        model = manifests[0]["job"]["model"]
        if model != job["model"]:
            raise CheckpointError(f"{manifest_path(directory, 0, epoch)} belongs to another job (model: saved {model}, "
                                  f"this job {job['model']}); resume with the same model or use a new checkpoint "
                                  "directory")
        problems = [p for p in (damage(directory, r, epoch) for r in range(len(manifests))) if p]
        if not problems:
            return epoch
        warn(f"{problems[0]}; skipping epoch {epoch}" + (f" and resuming after epoch {epoch - 1} if it is whole"
                                                          if epoch else ""))
    return None


def load(directory: str | os.PathLike, rank: int, epoch: int) -> dict[str, Any]:
    """Load (rank, epoch) with ``weights_only=True``, memory-mapped: a tensor is read from the file only
    when it is used.

    Raises:
        CheckpointError: the file cannot be read as a checkpoint (one line; never advises
            ``weights_only=False``).
    """
    f = path(directory, rank, epoch)
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for a damaged file; all mean the same here
        raise CheckpointError(f"{f} cannot be read as a checkpoint ({one_line(e, 160)}); it is damaged: "
                              "delete it or resume from another directory") from None


def history(directory: str | os.PathLike, epoch: int) -> list[dict[str, Any]]:
    """The training history the saving job's workers saved with ``epoch`` (every record up to its end),
    by step; only the files that hold records are opened."""
    manifests = whole(directory, epoch) or []
    records = [h for r, m in enumerate(manifests) if m["holds"]["history"] for h in load(directory, r, epoch)["history"]]
    return sorted(records, key=lambda h: h["step"])


def holders(manifests: list[dict[str, Any]], what: str, prefer: int | None = None) -> dict[str, int]:
    """Each name the files hold under ``what`` (``"model"``, ``"optimizer"``), with the rank of a file
    holding it: ``prefer``'s where it holds the name, else the lowest rank's."""
    ranks = list(range(len(manifests)))
    if prefer is not None and prefer in ranks:
        ranks.remove(prefer)
        ranks.insert(0, prefer)
    where: dict[str, int] = {}
    for r in ranks:
        for name in manifests[r]["holds"][what]:
            where.setdefault(name, r)
    return where


def newest_whole(directory: str | os.PathLike) -> int | None:
    """The newest epoch the saving job's every worker saved (whatever its files' state), or None."""
    saved = epochs_saved(directory)
    return next((e for e in sorted(set(saved.get(0, [])), reverse=True) if whole(directory, e, saved)), None)


def assemble(model: nn.Module, directory: str | os.PathLike, epoch: int | None = None) -> nn.Module:
    """A copy of ``model`` with the weights every worker saved for ``epoch`` (default: the newest epoch
    all workers completed), e.g. to evaluate or deploy a checkpointed run. Each tensor is read from one
    file that holds it (a data-parallel job's every worker holds the whole model).

    Raises:
        CheckpointError: no epoch that every worker saved, or a damaged file.
    """
    epoch = newest_whole(directory) if epoch is None else epoch
    manifests = whole(directory, epoch) if epoch is not None else None
    if epoch is None or manifests is None:
        raise CheckpointError(f"{directory}: no epoch {'' if epoch is None else epoch} saved by every worker of "
                              "the job; train with checkpoint_dir set (keep_checkpoints=None keeps every epoch)")
    state: dict[str, torch.Tensor] = {}
    files: dict[int, dict[str, Any]] = {}
    for name, r in holders(manifests, "model").items():
        if r not in files:
            files[r] = load(directory, r, epoch)
        state[name] = files[r]["model"][name]
    full = copy.deepcopy(model)
    full.load_state_dict(state)
    return full
