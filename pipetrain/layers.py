"""From a model to an ordered list of layers, and from a layer range to a runnable stage.

Two ways in:

* ``nn.Sequential``: each child is one layer; what a child returns goes to the next one as is.
* any module ``torch.fx`` can trace: the graph's nodes, in their (topological) order, are the layers,
  leaving out inputs, the output and attribute reads (``get_attr`` nodes are re-read wherever they are
  used). The cut after layer k carries every value made at or before k and used after k, so a cut
  inside a residual block carries both branches.
* a module fx cannot trace (control flow on shapes, Hugging Face models): ``torch.export`` captures it
  on an example minibatch (for that minibatch's shapes), and its graph's nodes
  (ATen operators) are the layers, as with fx. Parameters and buffers stay the model's own objects, read
  where they are used. What the model returns (a dict, a ``ModelOutput``) is rebuilt from the graph's
  flat outputs by the last stage, so ``loss_fn`` gets it as the model returns it. A Hugging Face
  model's key/value cache is off while it is captured: training reads none (:func:`_without_cache`).

Every layer of a graph also has a module path (``transformer.h.2.attn``: the submodule whose forward made
it), so stages can begin at a named submodule (:func:`split_points`).

A stage module maps what crosses the cut before its first layer to what crosses the cut after its last
one: one object in, one object out (a tensor, or a tuple of tensors for an fx cut). The stage's
``state_dict`` keys are the original model's, so the stages' states merge back into the full model.

Keyword inputs: when the example minibatch is :class:`~pipetrain.batches.KeywordInputs` (a dataset of
dictionary items), the model is called ``model(**inputs)``: fx traces its forward as usual and
``torch.export`` captures it with the entries as keyword arguments. The first stage then takes the model's
inputs by name, as the model does: its placeholders are the model's own (the forward's parameters, with
their defaults, for fx; the dict's keys for export), so it is called ``stage(**inputs)``
(:func:`pipetrain.batches.call`) and the order of the dict's entries does not matter. An input a later
layer uses crosses the cuts like any other value. Later stages take what crosses their cut, as always.
"""
from __future__ import annotations

import bisect
import contextlib
import inspect
import operator
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from pipetrain.batches import KeywordInputs, to_device
from pipetrain.errors import one_line


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
        model: an ``nn.Sequential``, a module that ``torch.fx.symbolic_trace`` accepts, or one that
            ``torch.export.export(model, (example,))`` (for keyword inputs:
            ``torch.export.export(model, (), example)``) captures.
        example: one minibatch of model input (what a worker calls the model with): what
            ``torch.export`` captures a model fx cannot trace on; :class:`~pipetrain.batches.KeywordInputs`
            make the first stage take keyword inputs (see the module docstring).

    Attributes:
        names: each layer's name (a child's name, or a graph node's).
        paths: each layer's module path: the child's name, or the submodule a node came from ('' for
            the model's own forward).
        captured_by: ``"sequential"``, ``"fx"`` or ``"export"``.
        device: where the model's tensors are (the meta device for a model built there), which
            ``torch.export`` captures it on: the example minibatch is moved there first.

    Raises:
        LayerError: the model can be neither traced nor exported (the message names both failures), or
            has no layers.
    """

    def __init__(self, model: nn.Module, example: Any = None) -> None:
        self.model = model
        tensors = [*model.parameters(), *model.buffers()]
        self.device = torch.device("meta") if any(t.is_meta for t in tensors) else \
            tensors[0].device if tensors else torch.device("cpu")
        example = to_device(example, self.device)
        self._graph: fx.Graph | None = None
        self._root: nn.Module = model
        self._saved: set[str] | None = None  # the model's state_dict keys, read at the first graph stage
        self.keywords = isinstance(example, KeywordInputs)
        if isinstance(model, nn.Sequential) and self.keywords:
            raise LayerError("an nn.Sequential takes one input, but the dataset's items are dictionaries (keyword "
                             "inputs); wrap the layers in a module whose forward takes them by name")
        if isinstance(model, nn.Sequential):
            self.names = list(model._modules)
            self.paths = list(self.names)
            self.captured_by = "sequential"
        else:
            self._root, self.captured_by = _capture(model, example)
            graph = self._root.graph
            assert isinstance(graph, fx.Graph)
            self._graph = graph
            self._nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")
                           and not (n.op == "call_module" and n.target == "_guards_fn")]  # export's input checks
            self._inputs = [n for n in graph.nodes if n.op == "placeholder"]
            self._output = next(n for n in graph.nodes if n.op == "output")
            self.names = [n.name for n in self._nodes]
            self.paths = [_module_path(n) for n in self._nodes]
        if not self.names:
            raise LayerError(f"{type(model).__name__} has no layers to place on stages")

    @property
    def labels(self) -> list[str]:
        """Each layer as people read it: ``path:name`` (or the name alone where path and name agree or
        the path is the model itself)."""
        return [n if p in ("", n) else f"{p}:{n}" for p, n in zip(self.paths, self.names)]

    def boundaries(self, stages: Sequence[int | str]) -> list[int]:
        """First-layer indices from split points given as indices or submodule names (:func:`split_points`)."""
        return split_points(stages, self.labels, type(self.model).__name__)

    def shared_parameters(self, boundaries: list[int]) -> dict[str, list[int]]:
        """Trainable parameters read by layers of more than one stage (tied weights), with those stages.

        A parameter counts wherever a layer reads it: an attribute read (``F.linear(x, self.emb.weight)``)
        or a submodule call whose module holds it (``self.head.weight = self.emb.weight``, or the children
        of an ``nn.Sequential``). Each goes by its first name in ``model.named_parameters()``."""
        out = {}
        for name, (layers, _) in self.tied_layers().items():
            stages = stages_of(layers, boundaries)
            if len(stages) > 1:
                out[name] = stages
        return out

    def tied_layers(self) -> dict[str, tuple[list[int], int]]:
        """Trainable parameters that several layers read, by first name: those layers and its bytes."""
        users: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for k, params in enumerate(self._reads()):
            for p in params:
                if p.requires_grad:
                    users.setdefault(id(p), (p, set()))[1].add(k)
        first: dict[int, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), name)
        return {first[i]: (sorted(ks), p.numel() * p.element_size()) for i, (p, ks) in users.items()
                if len(ks) > 1 and i in first}

    def _reads(self) -> list[list[nn.Parameter]]:
        """The parameters each layer reads."""
        if self._graph is None:
            assert isinstance(self.model, nn.Sequential)
            return [list(child.parameters()) for child in self.model.children()]
        reads: list[list[nn.Parameter]] = []
        for n in self._nodes:
            found = [_attr(self._root, a.target) for a in n.all_input_nodes if a.op == "get_attr"]
            if n.op == "call_module":
                found += list(self._root.get_submodule(str(n.target)).parameters())
            reads.append([p for p in found if isinstance(p, nn.Parameter)])
        return reads

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
        # a value is a node, or (a list of tensors crossing a cut element by element) a list of nodes
        env: dict[fx.Node, Any] = {}
        live_in = self._inputs if first == 0 else self._live_after(first - 1)
        if first == 0 and self.keywords:  # the model's own inputs, by name
            for v in live_in:
                default = v.args[0] if v.args else inspect.Signature.empty
                env[v] = graph.placeholder(str(v.target), default_value=default)
        elif first == 0 and len(live_in) == 1:
            env[live_in[0]] = graph.placeholder("x")
        else:  # a tuple: the previous cut's values, or several model inputs
            x, i = graph.placeholder("x"), 0
            for v in live_in:
                width = _width(v)
                if width is None:
                    env[v], i = graph.call_function(_item, (x, i)), i + 1
                else:
                    env[v], i = [graph.call_function(_item, (x, i + j)) for j in range(width)], i + width

        def arg(n: fx.Node) -> Any:
            if n not in env and n.op == "get_attr":
                env[n] = graph.node_copy(n, arg)
            return env[n]

        for n in self._nodes[first:last + 1]:
            env[n] = graph.node_copy(n, arg)
        if last < len(self) - 1:
            out: list[Any] = []
            for v in self._live_after(last):
                width, value = _width(v), env[v]
                if width is None:
                    out.append(value)
                elif isinstance(value, list):  # came in element by element: goes on so
                    out += value
                else:
                    out += [graph.call_function(operator.getitem, (value, j)) for j in range(width)]
            graph.output(tuple(out))
        elif self.captured_by == "export":  # the flat outputs, rebuilt into what the model returns
            flat = [fx.map_arg(v, arg) for v in self._output.args[0]]
            graph.output(graph.call_function(pytree.tree_unflatten, (flat, graph.get_attr(_OUT_SPEC))))
        else:
            graph.output(fx.map_arg(self._output.args[0], arg))
        stage = fx.GraphModule(self._root, graph, class_name="Stage")
        if self._saved is None:  # once: the profiler builds a stage per layer
            self._saved = set(self.model.state_dict(keep_vars=True))
        for name, _ in stage.named_buffers():  # fx registers every buffer it copies as saved
            if name not in self._saved:
                owner, _, leaf = name.rpartition(".")
                stage.get_submodule(owner)._non_persistent_buffers_set.add(leaf)
        return stage

    def takes_tuple(self, first: int) -> bool:
        """Whether the stage beginning at layer ``first`` takes a tuple (an fx cut, or several model
        inputs) rather than one value (or keyword inputs), even when one tensor crosses."""
        return self._graph is not None and not (first == 0 and (len(self._inputs) == 1 or self.keywords))

    def stages(self, boundaries: list[int]) -> Iterator[nn.Module]:
        """One module per stage, given the first layer index of each stage."""
        ends = [*boundaries[1:], len(self)]
        for first, end in zip(boundaries, ends):
            yield self.stage(first, end - 1)


def _item(xs: Any, i: int) -> Any:
    return xs[i]


def _width(node: fx.Node) -> int | None:
    """The length of a list or tuple of tensors ``node`` makes (an exported ``split``), which crosses a
    cut element by element; None for anything else (a tensor, or a graph without shapes: fx's)."""
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in value):
        return len(value)
    return None


_OUT_SPEC = "_pipetrain_out_spec"
"""The exported module's attribute holding how the model's output is rebuilt from the graph's."""

_EXPORTED: weakref.WeakKeyDictionary[nn.Module, tuple[Any, fx.GraphModule]] = weakref.WeakKeyDictionary()
"""Each model's export, with the shapes it was made for: a job's checks, plan and profile share one."""


def _capture(model: nn.Module, example: Any) -> tuple[fx.GraphModule, str]:
    """The model's graph: by ``torch.fx``, else by ``torch.export`` on ``example``."""
    try:
        return fx.symbolic_trace(model), "fx"
    except Exception as e:  # fx raises many types; all mean the same to the user
        fx_error = one_line(e, 300)
    name = type(model).__name__
    if example is None:
        raise LayerError(f"cannot trace {name} with torch.fx ({fx_error}); pass an nn.Sequential whose children "
                         "are the layers") from None
    keywords = isinstance(example, KeywordInputs)
    plain = dict(example) if keywords else example  # pytree and export take a dict, not a subclass of it
    key = pytree.tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t, (keywords, plain))
    cached = _EXPORTED.get(model)
    if cached is not None and cached[0] == key:
        return cached[1], "export"
    # [Note: static shapes] a dynamic batch dimension would make the batch size a graph value (a SymInt
    # node) that later layers read, so every cut would carry an int; the graph is made for the
    # example's shapes instead, which every minibatch of a job has (a pipeline drops the short tail).
    was_training = model.training
    try:
        model.train()  # captured with dropout on; the stages' own train()/eval() switch it (_follow_mode)
        args, kwargs = ((), plain) if keywords else ((example,), None)
        with _without_cache(model) as uncached:
            exported = torch.export.export(model, args, kwargs, strict=False).module()
    except Exception as e:  # export raises many types too
        hint = "pass the model with config.use_cache=False (its forward returns a key/value cache), " \
            if "cache_utils" in str(e) else ""  # a transformers cache object in the output
        raise LayerError(f"cannot split {name}: torch.fx cannot trace it ({fx_error}) and torch.export cannot "
                         f"capture it ({one_line(e, 300)}); {hint}pass an nn.Sequential whose children are the "
                         "layers, or train it with a data-parallel strategy (ddp, pipe-sgd), which take any "
                         "module") from None
    finally:
        model.train(was_training)
    if uncached:
        _tell_once(model, f"captured {name} with config.use_cache=False: training reads no key/value cache (the "
                          "model's own config is left as it was)")
    assert isinstance(exported, fx.GraphModule)
    _follow_mode(exported.graph)
    setattr(exported, _OUT_SPEC, exported._out_spec)
    _EXPORTED[model] = (key, exported)
    return exported, "export"


@contextlib.contextmanager
def _without_cache(model: nn.Module) -> Iterator[bool]:
    """Turn off a Hugging Face model's key/value cache while it is captured (yields whether it was on):
    with it on, the forward also returns a cache object, which is no tensor, and a training step never
    reads it. The graph keeps no reference to the config, so the flag goes back at once."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not True:
        yield False
        return
    config.use_cache = False
    try:
        yield True
    finally:
        config.use_cache = True


_TOLD: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models already told about, so a job's checks, plan and profile print a note once."""


def _tell_once(model: nn.Module, note: str) -> None:
    """Print ``note`` once per model, on rank 0 only, as pipetrain's other notes are printed."""
    if model not in _TOLD and os.environ.get("RANK", "0") == "0":
        print(f"pipetrain: {note}", flush=True)
    _TOLD.add(model)


def _follow_mode(graph: fx.Graph) -> None:
    """Make the exported graph's dropout and batch norm read the module's ``training`` flag, as the
    model's own modules do: export bakes in the mode it captured (train), so evaluation would drop
    units and update batch statistics. (BatchNorm's ``num_batches_tracked`` still counts evaluation
    passes; it only matters with ``momentum=None``.)"""
    aten = torch.ops.aten
    mode: fx.Node | None = None
    for n in list(graph.nodes):
        if n.target not in (aten.dropout.default, aten.batch_norm.default, aten.scaled_dot_product_attention.default):
            continue
        if mode is None:
            with graph.inserting_before(next(iter(graph.nodes))), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fx warns that `training` is no parameter, buffer or submodule
                mode = graph.get_attr("training")
        if n.target is aten.dropout.default:
            n.args = (*n.args[:2], mode)
        elif n.target is aten.batch_norm.default:
            n.args = (*n.args[:5], mode, *n.args[6:])
        elif p := n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0):
            with graph.inserting_before(n):
                p = graph.call_function(_when_training, (mode, p))
            if "dropout_p" in n.kwargs:
                n.kwargs = {**n.kwargs, "dropout_p": p}
            else:
                n.args = (*n.args[:4], p, *n.args[5:])


def _when_training(training: bool, p: float) -> float:
    return p if training else 0.0


def _module_path(node: fx.Node) -> str:
    """The submodule whose forward made ``node`` ('' for the model's own forward)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = str(list(stack.values())[-1][0])
        return "" if path.startswith("_") else path  # export's own helpers (e.g. its metadata hook)
    return str(node.target) if node.op == "call_module" else ""


def _attr(root: nn.Module, target: Any) -> Any:
    obj: Any = root
    for part in str(target).split("."):
        obj = getattr(obj, part)
    return obj


def split_points(stages: Sequence[int | str], labels: Sequence[str], model: str) -> list[int]:
    """First-layer indices from split points given as indices or names, on layers labelled as
    :attr:`LayeredModel.labels` (``path:node``). A name is a submodule (``"transformer.h.2"``: its first
    layer) or a layer's own name; a list that begins with a name begins the first stage at layer 0 (each
    name begins a later stage).

    Raises:
        LayerError: a name matches no layer, or the result does not fit (:func:`check_boundaries`).
    """
    def first_of(name: str) -> int:
        for k, label in enumerate(labels):
            path, _, own = label.rpartition(":")
            if name in (path, own) or (path or own).startswith(name + "."):
                return k
        depth = name.count(".") + 1  # suggest the submodules as deep as the name asked for
        paths = [label.rpartition(":")[0].split(".") for label in labels if label.rpartition(":")[0]]
        known = list(dict.fromkeys(".".join(p[:depth]) for p in paths if len(p) >= depth)) or \
            list(dict.fromkeys(p[0] for p in paths))
        shown = ", ".join(map(repr, known[:8])) + (", ..." if len(known) > 8 else "")
        raise LayerError(f"stages: no layer of {model} comes from a submodule named {name!r}; submodules with "
                         f"layers{' at that depth' if len(known) and len(known[0].split('.')) == depth else ''} "
                         f"are {shown or 'none'} (pipetrain profile lists every layer)")

    out = [s if isinstance(s, int) else first_of(s) for s in stages]
    if stages and isinstance(stages[0], str):
        out.insert(0, 0)
    check_boundaries(out, len(labels))
    return out


def stages_of(layers: Iterable[int], boundaries: Sequence[int]) -> list[int]:
    """The stages (in order, each once) that hold ``layers``, for stages beginning at ``boundaries``."""
    return sorted({bisect.bisect_right(boundaries, k) - 1 for k in layers})


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


def received(tensors: list[torch.Tensor], grads: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What a stage gets across a cut: leaves that collect the gradient with respect to each received
    floating-point tensor (when ``grads``), and copies of them for the stage to run on. The copies'
    gradient is the leaves' exactly, and a first operation that works in place (``ReLU(inplace=True)``,
    ``x += y``) neither fails on a leaf nor changes what was received."""
    leaves = [t.detach().requires_grad_(grads and t.is_floating_point()) for t in tensors]
    return leaves, [t.clone() for t in leaves]
