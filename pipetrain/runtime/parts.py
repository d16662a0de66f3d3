"""What each worker is sent to build its stages from, and how it builds them.

[Note: stage-only workers] No worker is sent, or holds, the whole model. The caller cuts the model
into layers once (:class:`pipetrain.layers.LayeredModel`) and sends each worker a :class:`Part` per
stage it holds: the stage's module alone (a graph stage as the source of its forward,
:mod:`pipetrain.stagecode`), its tensors on the meta device. The worker gives them values:

* a model given with real weights (and no ``weights`` file to replace them): from a file the caller
  wrote the stage's tensors to, once per stage (:class:`Shipment`), which the worker reads as it reads
  a weights file: a tensor's bytes are copied once to the file and once from it, where pickling them
  would copy them several times in both processes;
* else from the :class:`Source`: the ``weights`` file (the stage's tensors alone), then, for what no
  file holds, each module's initialization (:mod:`pipetrain.initialize`, the same whatever the split).

Data parallelism ships each worker the whole model the same way: it holds all of it anyway. Under
torchrun the rank is the caller: its parts keep the caller's tensors, nothing is written.
"""
from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pipetrain.initialize import assign, initial_values, meta_names
from pipetrain.layers import LayeredModel
from pipetrain.runtime.launch import under_torchrun
from pipetrain.runtime.scratch import scratch_dir
from pipetrain.stagecode import portable, set_device
from pipetrain.weightfiles import WeightFiles, write_shard


@dataclass
class Part:
    """One stage as it travels to the worker that holds it (for data parallelism: the whole model).

    Attributes:
        stage: the stage's index (0 for data parallelism).
        module: what the worker calls: the stage's layers, with the caller's tensors or tensors on the
            meta device that :func:`build` gives values.
        values: a safetensors file holding the stage's tensors (each under its first name in
            ``module``), written by the caller; None where the :class:`Source` gives them.
        layers: the stage's first and last layer, or None for the whole model (data parallelism).
    """

    stage: int
    module: nn.Module
    values: str | None = None
    layers: tuple[int, int] | None = None


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
        """The caller's tensors are the values (sent in a file, or shared in process): none to load or
        initialize."""
        return self.skeleton is None


class Shipment:
    """The parts a job's workers are sent: each stage's module on the meta device and, for a model with
    real weights, a file of its tensors, written once per stage (a replicated stage's workers, and
    data-parallel workers, read the same file). Used as a context: the files go in a temporary
    directory, removed on leaving it, once the workers are done.

    Args:
        layers: the model cut into layers, or None for data parallelism (the whole model).
        model: the caller's model.
        source: the job's :class:`Source`.
    """

    def __init__(self, layers: LayeredModel | None, model: nn.Module, source: Source) -> None:
        self.layers, self.model, self.source = layers, model, source
        self.directory: Path | None = None
        self._written: dict[int, str] = {}

    def __enter__(self) -> Shipment:
        if self.source.ships_tensors and not under_torchrun():  # under torchrun nothing travels
            self.directory = Path(scratch_dir("stages-"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def parts(self, stages: list[tuple[int, int, int]]) -> list[Part]:
        """The parts of a worker holding ``(stage, first layer, last layer)`` each (data parallelism: [])."""
        out, ranges = [], _ranges(stages)
        for s, module in modules_of(self.layers, self.model, stages):
            if self.directory is not None and s not in self._written:
                self._written[s] = str(self.directory / f"stage{s}.safetensors")
                write_shard(Path(self._written[s]), _first_names(module), durable=False)  # read once, then gone
            out.append(Part(s, meta_copy(module), self._written.get(s), ranges.get(s)))
        return out


def local_parts(layers: LayeredModel | None, model: nn.Module, stages: list[tuple[int, int, int]],
                source: Source) -> list[Part]:
    """The parts of a worker in this very process (under torchrun, or one worker run alone): the caller's
    tensors where it has them, nothing written."""
    ranges = _ranges(stages)
    return [Part(s, m if source.ships_tensors else meta_copy(m), layers=ranges.get(s))
            for s, m in modules_of(layers, model, stages)]


def _ranges(stages: list[tuple[int, int, int]]) -> dict[int, tuple[int, int]]:
    """stage -> (first layer, last layer) of ``(stage, first, last)`` triples."""
    return {s: (first, last) for s, first, last in stages}


def modules_of(layers: LayeredModel | None, model: nn.Module,
               stages: list[tuple[int, int, int]]) -> list[tuple[int, nn.Module]]:
    """``(stage, module)`` for each ``(stage, first layer, last layer)`` of ``layers``; None: the whole model."""
    if layers is None:
        return [(0, model)]
    return [(s, portable(layers.stage(first, last), layers.device)) for s, first, last in stages]


def _first_names(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each of ``module``'s tensors once, under its first name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def build(part: Part, source: Source, device: torch.device) -> nn.Module:
    """The stage of ``part`` on ``device``: meta tensors given their values from ``source`` first
    (read to the CPU or initialized there, then moved, so values do not depend on the device)."""
    module = part.module
    missing = [] if part.values is not None else meta_names(module)
    if part.values is not None:
        files = WeightFiles.open(part.values)
        assign(module, files.read(files.keys))
    elif missing:
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
    part = local_parts(layers, layers.model, [(0, first, last)], source)[0]
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
