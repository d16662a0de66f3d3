"""What each worker is sent to build its stages from, and how it builds them.

[Note: stage-only workers] No worker is sent, or holds, the whole model. The caller cuts the model
into layers once (:class:`pipetrain.layers.LayeredModel`) and sends each worker a :class:`Part` per
stage it holds: the stage's module alone (a graph stage as the source of its forward,
:mod:`pipetrain.stagecode`). The part carries the caller's tensors when the model has real weights
and no ``weights`` file replaces them; otherwise its tensors are on the meta device and the worker
gives them values from the :class:`Source`: the ``weights`` file (reading only the stage's
tensors), else each module's initialization (:mod:`pipetrain.initialize`, the same whatever the
split). Data parallelism sends each worker the whole model the same way: it holds all of it anyway.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from pipetrain.initialize import assign, initial_values, meta_names
from pipetrain.layers import LayeredModel
from pipetrain.stagecode import portable, set_device
from pipetrain.weightfiles import WeightFiles


@dataclass
class Part:
    """One stage as it travels to the worker that holds it (for data parallelism: the whole model).

    Attributes:
        stage: the stage's index (0 for data parallelism).
        module: what the worker calls: the stage's layers, with the caller's tensors or tensors on the
            meta device that :func:`build` gives values.
    """

    stage: int
    module: nn.Module


@dataclass(frozen=True)
class Source:
    """Where a worker's meta tensors get their values.

    Attributes:
        weights: a weights file or directory (:class:`pipetrain.weightfiles.WeightFiles`), or None.
        skeleton: the whole model on the meta device, whose modules' initialization gives a tensor no
            file holds its value (non-persistent buffers, or every tensor without ``weights``); None
            when the model has real weights and no file replaces them (nothing to give).
        aliases: every name of each tied parameter, by each of its names.
        seed: the job's seed, which the initialization derives each module's from.
    """

    weights: str | None = None
    skeleton: nn.Module | None = None
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    seed: int = 0

    @classmethod
    def of(cls, model: nn.Module, weights: str | None, seed: int) -> Source:
        """The source of ``model``'s workers: only what their values need travels."""
        if weights is None and not is_meta(model):
            return cls(aliases=aliases(model), seed=seed)
        return cls(weights, meta_copy(model), aliases(model), seed)

    @property
    def ships_tensors(self) -> bool:
        """Parts carry the caller's tensors (none to load or initialize)."""
        return self.skeleton is None


def parts_for(layers: LayeredModel | None, model: nn.Module, stages: list[tuple[int, int, int]],
              source: Source) -> list[Part]:
    """The parts of one worker: ``(stage, first layer, last layer)`` of ``layers`` each (``layers`` None:
    the whole ``model``, data parallelism), their tensors the caller's or on the meta device."""
    if layers is None:
        modules = [(0, model)]
    else:
        modules = [(s, portable(layers.stage(first, last), layers.device)) for s, first, last in stages]
    return [Part(s, m if source.ships_tensors else meta_copy(m)) for s, m in modules]


def build(part: Part, source: Source, device: torch.device) -> nn.Module:
    """The stage of ``part`` on ``device``: meta tensors given their values from ``source`` first
    (read to the CPU or initialized there, then moved, so values do not depend on the device)."""
    module = part.module
    missing = meta_names(module)
    if missing:
        values = _read(module, missing, source) if source.weights is not None else {}
        rest = [n for n in missing if n not in values]
        if rest:
            assert source.skeleton is not None
            values.update(initial_values(source.skeleton, rest, source.seed))
        assign(module, values)
    module.to(device)
    set_device(module, device)
    return module


def layer_stage(layers: LayeredModel, first: int, last: int, source: Source, device: torch.device) -> nn.Module:
    """Layers ``first..last`` of ``layers`` with real tensors on ``device``, for measuring them in this
    process one stage at a time (:func:`pipetrain.profiling.profile_model`), so that a model which fits
    nowhere whole never is whole: the caller's own stage where its tensors are real and on ``device``,
    else a stage built as a worker builds its own (:func:`build`), from a copy, so that the caller's
    tensors never move."""
    if source.ships_tensors and layers.device == torch.device(device):
        return layers.stage(first, last)
    part = parts_for(layers, layers.model, [(0, first, last)], source)[0]
    if source.ships_tensors:
        part = Part(0, copy.deepcopy(part.module))
    return build(part, source, device)


def _read(module: nn.Module, missing: list[str], source: Source) -> dict[str, torch.Tensor]:
    """The values of ``missing`` that the weights file holds: the module's persistent tensors (a tied
    parameter under any of its names), read alone."""
    assert source.weights is not None
    saved = module.state_dict(keep_vars=True)
    wanted = {n: (tuple(saved[n].shape), saved[n].dtype) for n in missing if n in saved}
    files = WeightFiles.open(source.weights)
    keys = files.check(wanted, source.aliases)
    got = files.read(sorted(set(keys.values())))
    return {n: got[k] for n, k in keys.items()}


def is_meta(module: nn.Module) -> bool:
    """Any of ``module``'s tensors is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose every parameter and buffer is an empty tensor of its shape and dtype on
    the meta device (a tied parameter stays one object): its structure, without copying any data."""
    memo: dict[int, object] = {}
    for t in _tensors(module):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of each parameter or buffer that has several (tied weights), by each of those names."""
    names: dict[int, list[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(n)
    return {n: tuple(group) for group in names.values() if len(group) > 1 for n in group}


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]
