"""The trained model on disk (``save=``), written stage by stage, never whole in one process.

Where ``save`` goes decides the format:

* a directory (any path not ending as below): what ``save_pretrained`` writes, so that Hugging Face's
  ``from_pretrained`` reads it: one safetensors shard per stage (``model-00002-of-00004.safetensors``),
  ``model.safetensors.index.json`` naming each tensor's shard, and the model's ``config.json`` where it
  has a Hugging Face configuration;
* ``*.safetensors``: one file, joined from the stages' shards by streaming them;
* ``*.pt``, ``*.pth`` or ``*.bin``: ``torch.save`` of the state dict, from the model gathered in the
  caller (so only for a model given with real weights).

Each stage's first worker writes its stage's shard (data parallelism: worker 0, the whole model). A
tied parameter is written once, under its first name, by the stage that owns it, as Hugging Face
leaves a tied ``lm_head.weight`` out; ``load_state_dict`` and ``from_pretrained`` tie it again.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.runtime import checkpoint
from pipetrain.weightfiles import join_shards, shard_name, write_index, write_shard

TORCH_FILES = (".pt", ".pth", ".bin")
"""Suffixes that make ``save`` a ``torch.save``'d state dict."""


def check_save(save: str | os.PathLike, gathered: bool) -> None:
    """One-line ValueError for a ``save`` path this job cannot write, before any worker starts."""
    path = Path(save)
    above = next((p for p in [directory_of(path), *directory_of(path).parents] if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"save={str(save)!r}: {above} is a file, not a directory; give a path you can write")
    if gathered_only(path) and not gathered:
        raise ValueError(f"save={str(save)!r} is a torch.save'd state dict of the model gathered in this process, "
                         "which a model built on the meta device never is; save to a .safetensors file or a "
                         "directory (written stage by stage)")
    if path.suffix not in (*TORCH_FILES, ".safetensors") and path.exists() and not path.is_dir():
        raise ValueError(f"save={str(save)!r} is a file; give a directory for the shards (or a path ending in "
                         ".safetensors for one file)")


def gathered_only(save: str | os.PathLike) -> bool:
    """``save`` is written from the model gathered in the caller (a ``torch.save`` file), not by the workers."""
    return Path(save).suffix in TORCH_FILES


def directory_of(save: str | os.PathLike) -> Path:
    """The directory ``save`` writes in: itself, or the one its file goes in."""
    path = Path(save)
    return path.parent if path.suffix in (*TORCH_FILES, ".safetensors") else path


def shard_path(save: str | os.PathLike, stage: int, stages: int) -> Path:
    """Where ``stage``'s shard goes: in the directory, or beside the one file it is joined into."""
    path = Path(save)
    if path.suffix == ".safetensors":
        return path.with_name(f".{path.name}.{shard_name(stage, stages)}")
    return path / shard_name(stage, stages)


def write_stage(save: str | os.PathLike, stage: int, stages: int, state: Mapping[str, torch.Tensor],
                borrowed: set[str], aliases: Mapping[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Write ``state`` (a stage module's) as ``stage``'s shard, each tensor under the first name of its
    tie and those another stage owns (``borrowed``, by any name) left out; return ``{shard file: its keys}``."""
    skip = {aliases.get(name, (name,))[0] for name in borrowed}
    tensors: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = aliases.get(key, (key,))[0]
        if name not in skip:
            tensors.setdefault(name, value)
    path = shard_path(save, stage, stages)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_shard(path, tensors)
    return {path.name: sorted(tensors)}


def finish(save: str | os.PathLike, shards: Mapping[str, list[str]], model: nn.Module,
           gathered: nn.Module | None) -> None:
    """After every stage wrote its shard: the index (a directory), the one joined file, or the state dict."""
    path = Path(save)
    if gathered_only(path):
        assert gathered is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(gathered.state_dict(), path)
    elif path.suffix == ".safetensors":
        parts = [path.with_name(name) for name in sorted(shards)]
        join_shards(parts, path)
        for part in parts:
            part.unlink()
    else:
        write_index(path, shards)
        config: Any = getattr(model, "config", None)
        if callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(path)


def write_checkpoint(save: str | os.PathLike, directory: str | os.PathLike, epoch: int, model: nn.Module,
                     aliases: Mapping[str, tuple[str, ...]]) -> None:
    """Write the model the workers checkpointed after ``epoch`` as ``save`` says (a directory or a
    ``.safetensors`` file), never whole in one process: a shard per checkpoint file that holds tensors
    no earlier file holds (a data-parallel job's first file, a replicated stage's first replica's), each
    file read alone, memory-mapped. ``model`` gives the Hugging Face configuration, if it has one."""
    manifests = checkpoint.whole(directory, epoch)
    assert manifests is not None, "resume_epoch chose this epoch"
    written: set[str] = set()
    plan: list[tuple[int, set[str]]] = []  # (rank, the names it holds that an earlier file writes)
    for rank, manifest in enumerate(manifests):
        held = manifest["holds"]["model"]
        new = {aliases.get(n, (n,))[0] for n in held} - written
        if new:
            plan.append((rank, {n for n in held if aliases.get(n, (n,))[0] not in new}))
            written |= new
    shards: dict[str, list[str]] = {}
    for shard, (rank, borrowed) in enumerate(plan):
        shards.update(write_stage(save, shard, len(plan), checkpoint.load(directory, rank, epoch)["model"], borrowed,
                                  aliases))
    finish(save, shards, model, None)
