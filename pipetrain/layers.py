"""From a model to an ordered list of layers, and from a layer range to a runnable stage.

Two ways in:

* ``nn.Sequential``: each child is one layer; what a child returns goes to the next one as is.
* any module ``torch.fx`` can trace: the graph's nodes, in their (topological) order, are the layers,
  leaving out inputs, the output and attribute reads (``get_attr`` nodes are re-read wherever they are
  used). The cut after layer k carries every value made at or before k and used after k, so a cut
  inside a residual block carries both branches.

A stage module maps what crosses the cut before its first layer to what crosses the cut after its last
one: one object in, one object out (a tensor, or a tuple of tensors for an fx cut). The stage's
``state_dict`` keys are the original model's, so the stages' states merge back into the full model.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn


class LayerError(ValueError):
    """A model that cannot be split, or stage boundaries that do not fit it."""


class _SequentialStage(nn.Module):
    """Children ``first..last`` of an ``nn.Sequential``, registered under their original names."""

    def __init__(self, model: nn.Sequential, first: int, last: int) -> None:
        super().__init__()
        names = list(model._modules)
        for name in names[first:last + 1]:
            self.add_module(name, model._modules[name])

    def forward(self, x: Any) -> Any:
        for child in self._modules.values():
            assert child is not None  # every entry was added from the model's children
            x = child(x)
        return x


class LayeredModel:
    """A model cut into layers.

    Args:
        model: an ``nn.Sequential`` or a module that ``torch.fx.symbolic_trace`` accepts.

    Raises:
        LayerError: the model cannot be traced (pass an ``nn.Sequential`` instead), or has no layers.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._graph: fx.Graph | None = None
        if isinstance(model, nn.Sequential):
            self.names = list(model._modules)
        else:
            try:
                traced = fx.symbolic_trace(model)
            except Exception as e:  # fx raises many types; all mean the same to the user
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise LayerError(f"cannot trace {type(model).__name__} with torch.fx ({first}); "
                                 "pass an nn.Sequential whose children are the layers") from None
            self._graph = traced.graph
            self._nodes = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
            self._inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
            self._output = next(n for n in traced.graph.nodes if n.op == "output")
            self.names = [n.name for n in self._nodes]
        if not self.names:
            raise LayerError(f"{type(model).__name__} has no layers to place on stages")

    def __len__(self) -> int:
        return len(self.names)

    def crossing(self, k: int) -> list[str]:
        """Names of the values crossing the cut after layer ``k`` (fx models; [] for Sequential)."""
        if self._graph is None:
            return []
        return [v.name for v in self._live_after(k)]

    def _live_after(self, k: int) -> list[fx.Node]:
        """Values made at or before layer k (inputs count as before layer 0) and used after it."""
        pos = {n: i for i, n in enumerate(self._nodes)}
        pos[self._output] = len(self._nodes)
        made = self._inputs + self._nodes[:k + 1]
        return [v for v in made if any(pos.get(u, -1) > k for u in v.users)]

    def stage(self, first: int, last: int) -> nn.Module:
        """The module running layers ``first..last`` (inclusive, 0-based)."""
        if not 0 <= first <= last < len(self):
            raise LayerError(f"layer range {first}..{last} is outside 0..{len(self) - 1}")
        if self._graph is None:
            assert isinstance(self.model, nn.Sequential)
            return _SequentialStage(self.model, first, last)
        return self._fx_stage(first, last)

    def _fx_stage(self, first: int, last: int) -> nn.Module:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        live_in = self._inputs if first == 0 else self._live_after(first - 1)
        x = graph.placeholder("x")
        if first == 0 and len(live_in) == 1:
            env[live_in[0]] = x
        else:  # a tuple: the previous cut's values, or several model inputs
            for i, v in enumerate(live_in):
                env[v] = graph.call_function(_item, (x, i))

        def arg(n: fx.Node) -> fx.Node:
            if n not in env and n.op == "get_attr":
                env[n] = graph.node_copy(n, arg)
            return env[n]

        for n in self._nodes[first:last + 1]:
            env[n] = graph.node_copy(n, arg)
        if last == len(self) - 1:
            graph.output(fx.map_arg(self._output.args[0], arg))
        else:
            graph.output(tuple(env[v] for v in self._live_after(last)))
        return fx.GraphModule(self.model, graph, class_name="Stage")

    def takes_tuple(self, first: int) -> bool:
        """Whether the stage beginning at layer ``first`` takes a tuple (an fx cut, or several model
        inputs) rather than one value, even when one tensor crosses."""
        return self._graph is not None and not (first == 0 and len(self._inputs) == 1)

    def stages(self, boundaries: list[int]) -> Iterator[nn.Module]:
        """One module per stage, given the first layer index of each stage."""
        ends = [*boundaries[1:], len(self)]
        for first, end in zip(boundaries, ends):
            yield self.stage(first, end - 1)


def _item(xs: Any, i: int) -> Any:
    return xs[i]


def check_boundaries(boundaries: list[int], num_layers: int) -> None:
    """Raise LayerError unless ``boundaries`` are first-layer indices 0 = b0 < b1 < ... < num_layers."""
    if not boundaries or boundaries[0] != 0:
        raise LayerError(f"stages={boundaries}: the first stage must start at layer 0")
    if len(boundaries) > num_layers:
        raise LayerError(f"stages={boundaries}: {len(boundaries)} stages but the model has only "
                         f"{num_layers} layers; use at most {num_layers} stages")
    if any(b >= a for a, b in zip(boundaries[1:], boundaries)) or boundaries[-1] >= num_layers:
        raise LayerError(f"stages={boundaries}: first-layer indices must increase strictly and stay "
                         f"below the layer count {num_layers}")


def flatten(value: Any) -> tuple[list[torch.Tensor], bool]:
    """A cut's value as a list of tensors, and whether it was a tuple."""
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return list(value), True
    raise LayerError(f"a stage boundary carries a {type(value).__name__}, not tensors; "
                     "move the boundary so only tensors cross it")


def unflatten(tensors: list[torch.Tensor], is_tuple: bool) -> Any:
    return tuple(tensors) if is_tuple else tensors[0]
