"""Per-layer profiles: plain, versioned, serializable data.

A profile is taken on a stated device at a stated minibatch size. For layer k it holds the forward and
backward seconds, the bytes of every tensor crossing the cut after layer k (what layer k's stage would
send to the next stage, and receive back as gradients), the layer's parameter bytes and the seconds of
an optimizer step on them (0 when not measured). A profile taken with a dataset also holds the seconds
a worker takes to build a minibatch's inputs and its targets from it (0 when not measured). A profile
may also carry the run set-up it was taken for (:class:`pipetrain.setup.Setup`: per-message cost,
how workers sharing cores slow each other).

JSON form (``version`` 1)::

    {"format": "pipetrain-profile", "version": 1, "model": "...", "device": "cpu",
     "batch_size": 32, "input_bytes": 8192,
     "layers": [{"name": "0", "forward_s": 0.001, "backward_s": 0.002,
                 "activation_bytes": 4096, "parameter_bytes": 1024, "optimizer_s": 0.0001}, ...],
     "inputs_s": 0.0002, "targets_s": 0.0001, "both_s": 0.00025,   (optional)
     "setup": {...}}   (optional; see pipetrain.setup.Setup)
"""
from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.layers import LayeredModel
from pipetrain.setup import Setup
from pipetrain.runtime.worker import collate_parts

FORMAT, VERSION = "pipetrain-profile", 1


class ProfileError(ValueError):
    """A profile file that cannot be read, or does not fit the model it is used with."""


@dataclass(frozen=True)
class LayerProfile:
    """One layer: seconds per minibatch and bytes."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    parameter_bytes: int
    optimizer_s: float = 0.0

    @property
    def compute_s(self) -> float:
        """Forward and backward seconds (the optimizer step is separate: it runs once per update)."""
        return self.forward_s + self.backward_s


@dataclass
class Profile:
    """Every layer of a model, in order, measured at ``batch_size`` on ``device``.

    ``inputs_s`` and ``targets_s``: seconds one worker takes to build a minibatch's inputs (its
    targets) from the dataset, each item fetched and its part collated, as the runtime's first (last)
    stage does once per minibatch; ``both_s``: both at once, each item fetched once, as a worker that
    is the first and the last stage builds them (:func:`time_batching`); 0 when not measured (a
    profile saved before ``both_s`` was: the other two added up stand in).
    """

    layers: list[LayerProfile]
    batch_size: int
    device: str
    model: str = ""
    input_bytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    setup: Setup | None = None
    inputs_s: float = 0.0
    targets_s: float = 0.0
    both_s: float = 0.0

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def parameter_bytes(self) -> int:
        """Bytes of every layer's parameters: the gradient a data-parallel step allreduces."""
        return sum(layer.parameter_bytes for layer in self.layers)

    def building_s(self, first: int, end: int) -> float:
        """Seconds the stage of layers ``first`` .. ``end - 1`` spends building a minibatch: its inputs
        if it holds the first layer, its targets if it holds the last, both at once if it holds all."""
        if first == 0 and end == len(self.layers) and self.both_s > 0:
            return self.both_s
        return (self.inputs_s if first == 0 else 0.0) + (self.targets_s if end == len(self.layers) else 0.0)

    def building_scaled(self, factor: float) -> Profile:
        """This profile with every time of building a minibatch (:meth:`building_s`) ``factor`` times its own."""
        return replace(self, inputs_s=self.inputs_s * factor, targets_s=self.targets_s * factor,
                       both_s=self.both_s * factor)

    def work_s(self) -> list[float]:
        """Each layer's seconds per minibatch on its stage: forward, backward and optimizer step, with
        building the minibatch (:meth:`building_s`)."""
        return [layer.compute_s + layer.optimizer_s + self.building_s(k, k + 1) for k, layer in enumerate(self.layers)]

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "device": self.device,
                "batch_size": self.batch_size, "input_bytes": self.input_bytes, "meta": self.meta,
                "layers": [asdict(layer) for layer in self.layers],
                **({"inputs_s": self.inputs_s, "targets_s": self.targets_s, "both_s": self.both_s}
                   if self.inputs_s or self.targets_s or self.both_s else {}),
                **({"setup": asdict(self.setup)} if self.setup is not None else {})}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | os.PathLike) -> "Profile":
        """Read our JSON (a ``.json`` file, or text starting with ``{`` or ``[``) or a PipeDream ``graph.txt``.

        Raises:
            ProfileError: a missing, empty, unreadable or malformed file (one line naming it and the fix).
        """
        make = _MAKE.format(path=path)
        text = read_text(path, "profile", make)
        if Path(path).suffix == ".json" or text.lstrip()[0] in "{[":
            return Profile.from_dict(parse_json(text, str(path), make), str(path))
        return Profile.from_pipedream(path, text=text)

    @staticmethod
    def from_pipedream(path: str | os.PathLike, batch_size: int = 0, *, text: str | None = None) -> "Profile":
        """Read a profile published with PipeDream (``graph.txt``; format in ``pipetrain/data/pipedream``).

        Layers are the graph's nodes in topological order, ties broken by node number; ``Input``
        nodes are the model input, not layers. A layer's ``activation_bytes`` are those of every node
        at or before it with an edge to a node after it (both branches inside a residual block);
        the last layer's are its own output.

        Args:
            path: the file.
            batch_size: the batch it was profiled at, if known (the file does not say; 0 = unknown).
            text: the file's contents, if already read.

        Raises:
            ProfileError: a malformed file (one line naming it, the line and the fix), or one with
                several nodes but no edges (the boundary costs would all be zero).
        """
        if text is None:
            text = read_text(path, "profile", _MAKE.format(path=path))
        nodes, edges = _read_graph(str(path), text)
        order = _topological(str(path), nodes, edges)
        inputs = [v for v in order if nodes[v].desc.startswith("Input")]
        order = [v for v in order if not nodes[v].desc.startswith("Input")]
        pos = {v: k for k, v in enumerate(order)} | {v: -1 for v in inputs}
        # A node's output crosses every cut from its own position up to its last consumer's.
        crossing = [0] * (len(order) + 1)
        for v, consumers in edges.items():
            last = max(pos[u] for u in consumers)
            if last > pos[v]:
                crossing[pos[v] + 1] += nodes[v].activation_bytes
                crossing[last + 1] -= nodes[v].activation_bytes
        cut = list(itertools.accumulate(crossing))[1:]  # cut[k]: after position k
        cut[-1] = nodes[order[-1]].activation_bytes
        layers = [LayerProfile(f"{v} {nodes[v].desc}", nodes[v].forward_ms / 1e3, nodes[v].backward_ms / 1e3,
                               cut[k], nodes[v].parameter_bytes) for k, v in enumerate(order)]
        return Profile(layers, batch_size, "gpu (PipeDream profile)", Path(path).name.split(".")[0],
                       sum(nodes[v].activation_bytes for v in inputs), {"source": "pipedream"})

    @staticmethod
    def from_dict(data: Any, source: str = "profile") -> "Profile":
        """The profile ``data`` holds (the JSON form in the module docstring).

        Raises:
            ProfileError: not a profile of this version, a missing, mistyped or negative field (one
                line naming ``source``, the entry and the field), or no layer taking any time.
        """
        check_header(data, FORMAT, VERSION, source, "`pipetrain profile`")
        try:
            layers = data.get("layers")
            if not isinstance(layers, list) or not layers:
                raise ValueError(f"profile: 'layers' is {layers!r:.40}, not a non-empty list of layer entries")
            entries = [_layer(k, d) for k, d in enumerate(layers)]
            if not any(x.compute_s for x in entries):
                raise ValueError("profile: every layer takes 0 s, so any throughput would be infinite")
            meta = data.get("meta", {})
            if not isinstance(meta, dict):
                raise ValueError(f"profile: 'meta' is {meta!r:.40}, not an object")
            setup = data.get("setup")
            # batch_size 0 means unknown, as in PipeDream's files; `pipetrain profile` never writes it
            return Profile(entries, _field(data, "batch_size", "profile", int), _field(data, "device", "profile", str),
                           str(data.get("model", "")), _field(data, "input_bytes", "profile", int, 0), meta,
                           None if setup is None else Setup.from_dict(setup, _field),
                           *(_field(data, name, "profile", float, 0.0) for name in ("inputs_s", "targets_s", "both_s")))
        except ValueError as e:
            raise ProfileError(f"{source}: malformed {e}; regenerate it with `pipetrain profile`") from None


_MAKE = "`pipetrain profile MODULE:FACTORY --batch-size B -o {path}`"


def _layer(k: int, entry: Any) -> LayerProfile:
    """Layer entry ``k`` of a profile's JSON; ValueError (naming it and the field) if it is malformed."""
    if not isinstance(entry, dict):
        raise ValueError(f"layer entry {k}: {entry!r:.40} is not an object")
    where = f"layer entry {k} ({entry.get('name')!r:.40})"
    return LayerProfile(_field(entry, "name", where, str), _field(entry, "forward_s", where, float),
                        _field(entry, "backward_s", where, float), _field(entry, "activation_bytes", where, int),
                        _field(entry, "parameter_bytes", where, int), _field(entry, "optimizer_s", where, float, 0.0))


def _field(entry: dict[str, Any], key: str, where: str, kind: type, default: Any = None) -> Any:
    """``entry[key]`` (required unless ``default`` is given) as ``kind``: any value for ``str``, else
    a finite number >= 0, a whole one for ``int``; ValueError naming ``where`` and ``key`` otherwise."""
    if key not in entry and default is None:
        raise ValueError(f"{where}: no {key!r}")
    value = entry.get(key, default)
    if kind is str:
        return str(value)
    whole = kind is not int or (isinstance(value, (int, float)) and float(value).is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not whole:
        raise ValueError(f"{where}: {key!r} is {value!r:.40}, not {'an integer' if kind is int else 'a number'}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {key!r} is {value!r}, not a finite number >= 0")
    return kind(value)


def read_text(path: str | os.PathLike, kind: str, make: str, error: type[ValueError] = ProfileError) -> str:
    """The text of a ``kind`` file ("profile", "plan"), or ``error``: one line naming the file and
    saying to make one with ``make``."""
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise error(f"{path}: no such {kind} file; make one with {make}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read it as text ({e}); make one with {make}") from None
    if not text.strip():
        raise error(f"{path}: the file is empty; make one with {make}")
    return text


def parse_json(text: str, source: str, make: str, error: type[ValueError] = ProfileError) -> Any:
    """``json.loads(text)``, or ``error``: one line with the place and whether the text looks cut short
    (it opens an object or list and does not close one)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        opened, closed = text.lstrip()[:1] in ("{", "["), text.rstrip().endswith(("}", "]"))
        cut = " (truncated?)" if opened and not closed else ""
        raise error(f"{source}: not valid JSON{cut}: {e}; make one with {make}") from None


def check_header(data: Any, fmt: str, version: int, source: str, make: str,
                 error: type[ValueError] = ProfileError) -> None:
    """Raise ``error`` (one line) unless ``data`` is an object of format ``fmt`` at ``version``."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise error(f"{source}: not a {fmt} version {version} file; make one with {make}")
    found = data.get("version")
    if isinstance(found, int) and found > version:
        raise error(f"{source}: written by a newer pipetrain ({fmt} version {found}; this one reads {version}); "
                    f"upgrade pipetrain or make it again with {make}")
    if found != version:
        raise error(f"{source}: not a {fmt} version {version} file (its version is {found!r}); make one with {make}")


def profile_model(model: nn.Module, sample_batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                  *, optimizer: Callable[..., torch.optim.Optimizer] | None = None, repeats: int = 10,
                  warmup: int = 2) -> Profile:
    """Measure every layer of ``model`` on one minibatch.

    Layer k runs alone, as ``LayeredModel(model).stage(k, k)``, on what layer k - 1 returned, so its
    times are what a stage holding it would spend. Times are medians of ``repeats`` runs after
    ``warmup`` runs. A layer's backward is seeded with ones for each output (or, for the last layer,
    starts from ``loss_fn``) and computes the gradients of its parameters and, after layer 0, of its
    inputs, as a pipeline stage must send those back. The model's buffers (e.g. batch-norm
    statistics) are restored afterwards and no ``.grad`` is touched.

    Args:
        model: an ``nn.Sequential``, or a module ``torch.fx`` traces or ``torch.export`` captures (on
            this minibatch), on the device to profile.
        sample_batch: one minibatch of model input (a tensor, or a tuple for several inputs); with
            ``loss_fn``, an ``(input, target)`` pair as a dataset gives.
        loss_fn: ``loss_fn(output, target)``, timed as part of the last layer.
        optimizer: the training's optimizer factory (e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``):
            each layer's ``optimizer_s`` is one step of it on the layer's parameters (after
            ``warmup`` steps, which create its state); the parameters are restored afterwards.
        repeats: timed runs per layer.
        warmup: untimed runs per layer before those.

    Returns:
        The profile, at the batch size and on the device of the input.

    Raises:
        LayerError: the model cannot be cut into layers.
        ValueError: ``repeats < 1``, no input tensors or samples, or no ``(input, target)`` pair with ``loss_fn``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if loss_fn is not None and not (isinstance(sample_batch, (tuple, list)) and len(sample_batch) == 2):
        raise ValueError("with loss_fn, sample_batch must be an (input, target) pair")
    value, target = sample_batch if loss_fn is not None else (sample_batch, None)
    inputs = _tensors(value)
    if not inputs:
        raise ValueError("sample_batch holds no tensors; pass one minibatch of model input")
    if inputs[0].dim() and inputs[0].shape[0] == 0:
        raise ValueError("sample_batch holds 0 samples; pass a minibatch of at least one")
    layers = LayeredModel(model, value)
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    measured = []
    try:
        for k in range(len(layers)):
            stage = layers.stage(k, k)
            last = loss_fn is not None and k == len(layers) - 1
            head = (lambda y: loss_fn(y, target)) if last and loss_fn is not None else None
            fwd, bwd, value = _time_layer(stage, value, k > 0, head, repeats, warmup)
            param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
            step = _time_optimizer(stage, optimizer, repeats, warmup) if optimizer is not None else 0.0
            measured.append(LayerProfile(layers.labels[k], fwd, bwd, _nbytes(value), param_bytes, step))
    finally:
        with torch.no_grad():
            for buffer, copy in saved:
                buffer.copy_(copy)
    first = inputs[0]
    return Profile(measured, int(first.shape[0]) if first.dim() else 1, str(first.device), type(model).__name__,
                   _nbytes(inputs))


def as_minibatch(micro: Profile, m: int) -> Profile:
    """The profile of a minibatch run as ``m`` microbatches of ``micro``'s batch one after another, for
    simulating a microbatched schedule (which times a microbatch as its stage's minibatch time over
    ``m``): forward, backward and bytes ``m`` times ``micro``'s, the optimizer step once. A profile taken
    at the whole minibatch and divided by ``m`` is optimistic on a CPU, whose time per row is not the
    same at every batch (a 64-row matmul took about 25% more per row than a 256-row one)."""
    layers = [replace(x, forward_s=x.forward_s * m, backward_s=x.backward_s * m, activation_bytes=x.activation_bytes * m)
              for x in micro.layers]
    return replace(micro.building_scaled(m), layers=layers, batch_size=micro.batch_size * m,
                   input_bytes=micro.input_bytes * m,
                   meta={**micro.meta, "measured_at_batch": micro.batch_size, "microbatches": m})


def time_batching(dataset: Any, rows: int, repeats: int = 3) -> tuple[float, float, float]:
    """Seconds to build a minibatch of the first ``rows`` items' inputs, of their targets, and of both at
    once, from ``dataset`` (of ``(input, target)`` pairs), each as a worker builds it
    (:func:`pipetrain.runtime.worker.collate_parts`; its first stage builds the inputs, its last the
    targets, a worker that is both builds both). Medians of ``repeats`` runs after one untimed, the
    three interleaved so that each sees the same phases of the machine."""
    items = range(min(rows, len(dataset)))
    kinds = ((0,), (1,), (0, 1))
    times: list[list[float]] = [[] for _ in kinds]
    for _ in range(repeats + 1):
        for k, parts in enumerate(kinds):
            start = time.perf_counter()
            collate_parts(dataset, items, parts)
            times[k].append(time.perf_counter() - start)
    inputs_s, targets_s, both_s = (statistics.median(t[1:]) for t in times)
    return inputs_s, targets_s, both_s


def _time_layer(stage: nn.Module, x: Any, input_grads: bool, loss: Callable[[Any], torch.Tensor] | None,
                repeats: int, warmup: int) -> tuple[float, float, Any]:
    """(median forward s, median backward s, the output detached) of one layer."""
    params = [p for p in stage.parameters() if p.requires_grad]
    cuda = any(t.is_cuda for t in _tensors(x)) or any(p.is_cuda for p in params)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    forward, backward = [], []
    for run in range(warmup + repeats):
        leaves = _map(x, lambda t: t.detach().requires_grad_(input_grads and t.is_floating_point()))
        # The layer gets copies: an in-place first op must not fail on a leaf or change the input.
        feed = _map(leaves, torch.clone)
        sync()
        t0 = time.perf_counter()
        y = stage(feed)
        head = y if loss is None else loss(y)
        sync()
        t1 = time.perf_counter()
        roots = [t for t in _tensors(head) if t.requires_grad]
        wrt = [t for t in _tensors(leaves) if t.requires_grad] + params
        seeds = [torch.ones_like(t) for t in roots]
        sync()
        t2 = time.perf_counter()
        if roots and wrt:
            torch.autograd.grad(roots, wrt, seeds, allow_unused=True)
        sync()
        if run >= warmup:
            forward.append(t1 - t0)
            backward.append(time.perf_counter() - t2)
    return statistics.median(forward), statistics.median(backward), _map(y, torch.Tensor.detach)


def _time_optimizer(stage: nn.Module, optimizer: Callable[..., torch.optim.Optimizer], repeats: int,
                    warmup: int) -> float:
    """Median seconds of one ``optimizer`` step (with ``zero_grad``) on ``stage``'s trainable parameters,
    with gradients of ones; the parameters and their ``.grad`` are left as they were."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if not params:
        return 0.0
    before = [(p.detach().clone(), p.grad) for p in params]
    cuda = any(p.is_cuda for p in params)
    opt = optimizer(params)
    times = []
    try:
        for run in range(warmup + max(repeats, 1)):
            for p in params:
                p.grad = torch.ones_like(p)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            if run >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        with torch.no_grad():
            for p, (data, grad) in zip(params, before):
                p.copy_(data)
                p.grad = grad
    return statistics.median(times)


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` on every tensor of a nested tuple/list/dict; other values (e.g. sizes) pass through."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a nested tuple/list/dict, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for v in items for t in _tensors(v)]


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


@dataclass(frozen=True)
class _Node:
    desc: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    parameter_bytes: int


_NODE_LINE = re.compile(r"^(\S+) -- (.*) -- (forward_compute_time=.*)$")
_FIELD = re.compile(r"(\w+)=(\[[^\]]*\]|[^,]+)")
_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_GRAPH_FIX = ("expected `nodeN -- Desc -- forward_compute_time=MS, backward_compute_time=MS, "
              "activation_size=BYTES, parameter_size=BYTES` or a tab and `nodeA -- nodeB`")


def _read_graph(source: str, text: str) -> tuple[dict[str, _Node], dict[str, list[str]]]:
    """Nodes by id and, per node, the nodes it feeds, from graph.txt text."""
    nodes: dict[str, _Node] = {}
    node_line: dict[str, int] = {}
    edges: dict[str, list[str]] = {}
    edge_lines: list[tuple[int, str, str]] = []
    lines = text.rstrip().splitlines()

    def cut(lineno: int) -> str:
        """A hint on the last line: a file cut short ends in a partial line."""
        return " (the last line: truncated?)" if lineno == len(lines) > 1 else ""

    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.startswith("\t"):
            ends = line.strip().split(" -- ")
            if len(ends) != 2:
                raise ProfileError(f"{source}:{lineno}: cannot read edge line {line.strip()!r}{cut(lineno)}; "
                                   f"{_GRAPH_FIX}")
            edge_lines.append((lineno, ends[0], ends[1]))
            continue
        m = _NODE_LINE.match(line.strip())
        fields = dict(_FIELD.findall(m.group(3))) if m else {}
        try:
            values = {k: _number(fields[k]) for k in _FIELDS}
        except (KeyError, ValueError):
            raise ProfileError(f"{source}:{lineno}: cannot read node line {line.strip()[:60]!r}{cut(lineno)}; "
                               f"{_GRAPH_FIX}") from None
        node = m.group(1)  # type: ignore[union-attr]
        bad = next((k for k, v in values.items() if not (math.isfinite(v) and v >= 0)), None)
        if bad:
            raise ProfileError(f"{source}:{lineno}: node {node} has {bad}={fields[bad].strip()}; times and sizes "
                               "must be finite and >= 0")
        if node in node_line:
            raise ProfileError(f"{source}:{lineno}: node {node} again (first at line {node_line[node]}); "
                               "give each node one node line")
        node_line[node] = lineno
        forward, backward, act, par = values.values()
        nodes[node] = _Node(m.group(2), forward, backward, round(act), round(par))  # type: ignore[union-attr]
    for lineno, a, b in edge_lines:
        if a not in nodes or b not in nodes:
            raise ProfileError(f"{source}:{lineno}: edge {a} -- {b} names a node with no node line{cut(lineno)}; "
                               "add the node line or drop the edge")
        edges.setdefault(a, []).append(b)
    layers = [n for n in nodes.values() if not n.desc.startswith("Input")]
    if not layers:
        raise ProfileError(f"{source}: no layer nodes found; give a PipeDream graph.txt ({_GRAPH_FIX})")
    if not any(n.forward_ms + n.backward_ms for n in layers):
        raise ProfileError(f"{source}: every layer node takes 0 ms, so any throughput would be infinite; "
                           "give a graph.txt with measured times")
    if len(nodes) > 1 and not edges:
        raise ProfileError(f"{source}: has {len(nodes)} nodes but no edges: the boundary costs would all be zero; "
                           "give the whole graph.txt, whose edge lines (a tab, then `nodeA -- nodeB`) follow "
                           "the node lines")
    return nodes, edges


def _number(text: str) -> float:
    """``12.5`` or a list ``[a; b; ...]`` (several outputs), summed."""
    text = text.strip()
    if text.startswith("["):
        if not text.endswith("]"):
            raise ValueError(f"{text!r} has no closing ']'")
        return sum(float(x) for x in text[1:-1].split(";") if x.strip())
    return float(text)


def _topological(source: str, nodes: dict[str, _Node], edges: dict[str, list[str]]) -> list[str]:
    """Kahn's algorithm; among ready nodes the lowest node number goes first, so the order is
    deterministic and follows the file's numbering where the graph allows."""
    indegree = dict.fromkeys(nodes, 0)
    for consumers in edges.values():
        for u in consumers:
            indegree[u] += 1
    ready = [(_natural(v), v) for v, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, v = heapq.heappop(ready)
        order.append(v)
        for u in edges.get(v, []):
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, (_natural(u), u))
    if len(order) < len(nodes):
        stuck = sorted((v for v in nodes if v not in set(order)), key=_natural)[:3]
        raise ProfileError(f"{source}: the edges form a cycle through {', '.join(stuck)}; "
                           "a profile graph must be acyclic")
    return order


def _natural(name: str) -> tuple[str | int, ...]:
    """``node10`` sorts after ``node9``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
