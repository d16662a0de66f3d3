"""A stage as it travels to a worker: plain modules as they are, a graph stage as the source of its forward.

[Note: no tracing in a worker] A stage cut from a graph (:mod:`pipetrain.layers`) is an
``fx.GraphModule``. GraphModule pickles as its generated code and traces that code again where it is
loaded, and that trace runs whatever reads a buffer eagerly: a rotary embedding's tables become
constants of the captured values (and of the meta device, for a model built there). So a graph stage
travels as a :class:`CodeStage` instead: the source fx generated for its forward and the module tree
the forward reads, rebuilt in the worker by compiling the source, with no second trace. The worker
needs no graph: it only calls the stage.

[Note: capture device] ``torch.export`` records the device of every tensor a graph makes
(``arange(n, device=cpu)``). A stage captured on the CPU (or the meta device) would make those on
the CPU under a GPU worker. Every such device that equals the capture device reads the stage's
:data:`DEVICE` attribute instead, which :func:`set_device` points at the worker's device.
"""
from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.graph_module import _format_import_block, _forward_from_src
from torch.fx.node import map_aggregate
from torch.package import sys_importer

DEVICE = "_pipetrain_device"
"""The stage attribute a graph's device constants read."""


class CodeStage(nn.Module):
    """A graph stage rebuilt from the source of its forward: the module tree it reads (submodules,
    parameters, buffers, plain attributes) and ``source``, compiled once here."""

    def __init__(self, source: str, state: dict[str, Any]) -> None:
        super().__init__()
        self.__dict__.update({k: v.load() if isinstance(v, _Spec) else v for k, v in state.items()})
        self._source = source
        self._forward = _forward_from_src(source, {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(self, *args, **kwargs)

    @property
    def code(self) -> str:
        """The source of its forward, as ``fx.GraphModule.code`` gives a graph stage's."""
        return self._source

    def __reduce__(self) -> tuple[Any, ...]:
        state = {k: _Spec.of(v) if isinstance(v, pytree.TreeSpec) else v for k, v in self.__dict__.items()
                 if k not in ("_source", "_forward")}
        return CodeStage, (self._source, state)


class _Spec:
    """A pytree spec (how an exported model's output is rebuilt) as it travels: pickled on its own, as
    torch's pickling of a spec warns of its own deprecated leaf type."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def of(cls, spec: pytree.TreeSpec) -> _Spec:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return cls(pickle.dumps(spec))

    def load(self) -> pytree.TreeSpec:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return pickle.loads(self.data)


def portable(stage: nn.Module, capture_device: torch.device) -> nn.Module:
    """``stage`` as it can travel to a worker: a :class:`CodeStage` for a graph stage (its device
    constants equal to ``capture_device`` reading :data:`DEVICE`), any other module as it is. The
    CodeStage shares ``stage``'s submodules and tensors."""
    if not isinstance(stage, fx.GraphModule):
        return stage
    setattr(stage, DEVICE, capture_device)
    _read_device(stage.graph, capture_device)
    code = stage.recompile()
    state = {k: stage.__dict__[k] for k in ("training", "_parameters", "_buffers", "_non_persistent_buffers_set",
                                            "_modules")}
    state["_non_persistent_buffers_set"] = set(state["_non_persistent_buffers_set"])
    for node in stage.graph.nodes:  # plain attributes of the stage itself (an output's tree spec, the device)
        target = str(node.target)
        if node.op == "get_attr" and "." not in target and target not in state["_parameters"] \
                and target not in state["_buffers"] and target not in state["_modules"]:
            state[target] = getattr(stage, target)
    return CodeStage(_format_import_block(code.globals, sys_importer) + code.src, state)


def _read_device(graph: fx.Graph, device: torch.device) -> None:
    """Make every argument of ``graph`` that is ``device`` read the stage's :data:`DEVICE` attribute."""
    reader: fx.Node | None = None

    def swap(a: Any) -> Any:
        return reader if isinstance(a, torch.device) and a == device else a

    for node in list(graph.nodes):
        found = []
        map_aggregate((node.args, node.kwargs), lambda a: found.append(a) if isinstance(a, torch.device) else None)
        if not any(d == device for d in found):
            continue
        if reader is None:
            with graph.inserting_before(next(iter(graph.nodes))), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fx warns that a device is no parameter, buffer or submodule
                reader = graph.get_attr(DEVICE)
        node.args, node.kwargs = map_aggregate(node.args, swap), map_aggregate(node.kwargs, swap)


def set_device(stage: nn.Module, device: torch.device) -> None:
    """Point a stage's device constants at ``device``, where its tensors now are (a no-op for a stage
    without any)."""
    if hasattr(stage, DEVICE):
        setattr(stage, DEVICE, device)
