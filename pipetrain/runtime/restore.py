"""A worker's state from a checkpoint, found by the model's own names, so a job resumes on another
split, layout, world size or strategy than the one that saved it.

[Note: resume by name] Every checkpoint file keys its model state, and its optimizer state
(:func:`named_state`), by the model's names, and its manifest lists them
(:mod:`pipetrain.runtime.checkpoint`). A resuming worker reads each of its tensors, and each of its
trained parameters' optimizer state, from one file that holds it: its own rank's file where that
holds it, else the lowest rank's (a tied parameter is found under any of its names). The files are
memory-mapped, so only what the worker uses is read. Where the layout is the saving job's, each
worker's every name is in its own rank's file, so it goes on exactly as if it had never stopped.

Its weight version, learning-rate scheduler and random state come from one file, its *home*: the
file holding its first trained parameter's optimizer state (a worker that trains nothing: the file
of its first tensor, else its own rank's, or the last one). On another layout, random streams
(dropout) thus go on per old worker: two new workers whose first parameters one old worker held
draw the same stream, and a new worker's stream is not the one an unbroken run would have given
it. A run resumed on another split is exact for a model that draws no random numbers, and otherwise
equal only in distribution to an unbroken run. The saving job's whole history goes to the new job's
first reporting worker (:meth:`pipetrain.layout.Layout.reporter`), so none is counted twice.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.runtime import checkpoint
from pipetrain.runtime.checkpoint import CheckpointError


def optimized_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """The names ``module`` gives ``optimizer``'s parameters, in the order the optimizer holds them."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_state(optimizer: torch.optim.Optimizer, names: Sequence[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of torch's position in this optimizer,
    so whichever worker holds a parameter later can take its state:
    ``{"state": {name: {...}}, "param_groups": [{...hyperparameters..., "params": [names]}]}``.
    ``names``: the optimizer's parameters' names, in its order (:func:`optimized_names`)."""
    by_position = optimizer.state_dict()
    return {"state": {names[i]: s for i, s in by_position["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in by_position["param_groups"]]}


def load_named(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], names: Sequence[str]) -> None:
    """Load ``saved`` (:func:`named_state`'s form, perhaps merged from several files) into ``optimizer``,
    whose parameters are ``names`` in its order: each parameter's state by its name, each of the
    optimizer's groups the hyperparameters of the saved group holding its first parameter."""
    group_of = {n: g for g in saved["param_groups"] for n in g["params"]}
    position = {n: i for i, n in enumerate(names)}
    groups, first = [], 0
    for group in optimizer.param_groups:
        mine = names[first:first + len(group["params"])]
        first += len(mine)
        hyper = {k: v for k, v in group_of[mine[0]].items() if k != "params"}
        groups.append({**hyper, "params": [position[n] for n in mine]})
    optimizer.load_state_dict({"state": {position[n]: s for n, s in saved["state"].items() if n in position},
                               "param_groups": groups})


@dataclass
class Restored:
    """What one worker goes on from: its stage's ``model`` state, its ``optimizer`` state (named, by
    its own names), and from its home file its ``scheduler`` state, weight ``version`` and ``rng``
    state; and the saving job's ``history`` if it is the first reporter."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    version: int
    rng: dict[str, torch.Tensor]
    history: list[dict[str, Any]]


def restore(directory: str | os.PathLike, epoch: int, own: int, module: nn.Module, optimized: Sequence[str],
            aliases: Mapping[str, tuple[str, ...]], history: bool) -> Restored:
    """The state of the worker of rank ``own`` (a looped schedule's: the stage) holding ``module``
    and training ``optimized`` (names, in its optimizer's order), from the checkpoint of ``epoch``:
    [Note: resume by name]. ``aliases``: every name of each tied parameter; ``history``: take the
    saving job's history (this is the first reporter).

    Raises:
        CheckpointError: no file of the epoch holds one of the worker's names.
    """
    manifests = checkpoint.whole(directory, epoch)
    assert manifests is not None, "resume_epoch chose this epoch"
    file = functools.cache(lambda rank: checkpoint.load(directory, rank, epoch))
    model_at, optimizer_at = checkpoint.holders(manifests, "model", own), checkpoint.holders(manifests, "optimizer", own)

    def find(name: str, where: dict[str, int], what: str) -> tuple[int, str]:
        """The rank of the file holding ``name`` (under any of its names), and the name it holds it by."""
        for held in (name, *aliases.get(name, ())):
            if held in where:
                return where[held], held
        raise CheckpointError(f"{checkpoint.manifest_path(directory, 0, epoch)}: no file of epoch {epoch} holds the "
                              f"{what} of {name}; its checkpoint is incomplete, resume from another directory")

    model = {}
    for name in module.state_dict():
        rank, held = find(name, model_at, "tensor")
        model[name] = file(rank)["model"][held]
    state: dict[str, Any] = {}
    groups: dict[tuple[int, int], dict[str, Any]] = {}  # (file, group there) -> the group, with our names
    for name in optimized:
        rank, held = find(name, optimizer_at, "optimizer state")
        saved = file(rank)["optimizer"]
        at = next(i for i, g in enumerate(saved["param_groups"]) if held in g["params"])
        groups.setdefault((rank, at), {**saved["param_groups"][at], "params": []})["params"].append(name)
        if held in saved["state"]:
            # a copy: the worker updates it in place, and a mapped file's pages would stay on disk
            # after the file is deleted, for as long as the worker runs
            state[name] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved["state"][held].items()}
    if optimized:
        home = find(optimized[0], optimizer_at, "optimizer state")[0]
    elif model:
        home = find(next(iter(model)), model_at, "tensor")[0]
    else:
        home = min(own, len(manifests) - 1)
    return Restored(model, {"state": state, "param_groups": list(groups.values())}, file(home)["scheduler"],
                    file(home)["version"], file(home)["rng"], checkpoint.history(directory, epoch) if history else [])
