"""Per-layer profiles: plain, versioned, serializable data.

A profile is taken on a stated device at a stated minibatch size. For layer k it holds the forward and
backward seconds, the bytes of every tensor crossing the cut after layer k (what layer k's stage would
send to the next stage, and receive back as gradients), the layer's parameter bytes (and of those that
train, whose gradients take as much), the seconds of an optimizer step on them and the bytes of the
state the optimizer keeps for them (0 when not measured). A profile taken with a dataset also holds the seconds
a worker takes to build a minibatch's inputs and its targets from it (0 when not measured). A profile
may also carry the run set-up it was taken for (:class:`pipetrain.setup.Setup`: per-message cost,
how workers sharing cores slow each other), and the bytes a worker process holds before its stage
(:mod:`pipetrain.runtime.resident`).

JSON form (``version`` 1)::

    {"format": "pipetrain-profile", "version": 1, "model": "...", "device": "cpu",
     "batch_size": 32, "input_bytes": 8192,
     "layers": [{"name": "0", "forward_s": 0.001, "backward_s": 0.002,
                 "activation_bytes": 4096, "parameter_bytes": 1024, "optimizer_s": 0.0001,
                 "weight_backward_s": 0.001, "trainable_bytes": 1024, "optimizer_bytes": 2048}, ...],
                                        (weight_backward_s, trainable_bytes, optimizer_bytes optional)
     "inputs_s": 0.0002, "targets_s": 0.0001, "both_s": 0.00025,   (optional)
     "ties": [{"layers": [0, 9], "bytes": 4096}],   (optional: a parameter several layers read)
     "baseline_bytes": 250000000,   (optional)
     "setup": {...}}   (optional; see pipetrain.setup.Setup)
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pipetrain import costs
from pipetrain.jsonfile import check_header, parse_json, read_field, read_text
from pipetrain.profiling.graph import GraphError, read_graph
from pipetrain.setup import Setup

FORMAT, VERSION = "pipetrain-profile", 1


class ProfileError(ValueError):
    """A profile file that cannot be read, or does not fit the model it is used with."""


@dataclass(frozen=True)
class LayerProfile:
    """One layer: seconds per minibatch and bytes. ``weight_backward_s``: the part of ``backward_s``
    that computes the gradients of the layer's weights (the rest computes its input's); None when
    not measured. ``trainable_bytes``: the bytes of its parameters that train (``requires_grad``),
    whose gradients take as much; None when not measured (a profile from before it was, PipeDream's),
    read as every parameter. ``optimizer_bytes``: the bytes of the optimizer's state for them
    (momentum, Adam's two moments) after its warm-up steps; 0 when not measured."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    parameter_bytes: int
    optimizer_s: float = 0.0
    weight_backward_s: float | None = None
    trainable_bytes: int | None = None
    optimizer_bytes: int = 0

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the layer's gradients: its trainable parameters' (all of them when not measured)."""
        return self.parameter_bytes if self.trainable_bytes is None else self.trainable_bytes

    @property
    def weight_s(self) -> float:
        """Seconds of the weight-gradient part of the backward: as measured (at most ``backward_s``), or
        half the backward when not measured (a linear layer's two matrix products)."""
        return self.backward_s / 2 if self.weight_backward_s is None else min(self.weight_backward_s, self.backward_s)

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
    is the first and the last stage builds them (:func:`pipetrain.profiling.time_batching`); 0 when not
    measured (for ``both_s``, the other two added up then stand in). ``loaders``: the background
    processes each worker builds minibatches with (``pipetrain.train``'s ``loader_workers``; 0: inline),
    which hide building behind compute (:func:`pipetrain.costs.loading_wait_s`).

    ``ties``: for each parameter that several layers read (tied weights), those layers and its bytes;
    stages that hold them exchange its gradient and value every update (:mod:`pipetrain.runtime.tied`).

    ``baseline_bytes``: what a worker process holds before it builds its stage, on the device the
    profile was taken on: on the CPU the resident memory of a worker as the runtime starts one
    (:func:`pipetrain.runtime.resident.baseline`), on a GPU 0 (the device holds nothing before the
    stage); 0 when not measured. The memory prediction (:mod:`pipetrain.predict.memory`) and the
    planner's memory limit count it.
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
    loaders: int = 0
    ties: list[tuple[list[int], int]] = field(default_factory=list)
    baseline_bytes: int = 0

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def parameter_bytes(self) -> int:
        """Bytes of every layer's parameters: the gradient a data-parallel step allreduces."""
        return sum(layer.parameter_bytes for layer in self.layers)

    def building_s(self, first: int, end: int) -> float:
        """Seconds the stage of layers ``first`` .. ``end - 1`` spends building a minibatch: its inputs
        if it holds the first layer, its targets if it holds the last, both at once if it holds all;
        with loaders, what of it their work does not hide behind the stage's compute."""
        if first == 0 and end == len(self.layers) and self.both_s > 0:
            load = self.both_s
        else:
            load = (self.inputs_s if first == 0 else 0.0) + (self.targets_s if end == len(self.layers) else 0.0)
        compute = sum(x.compute_s + x.optimizer_s for x in self.layers[first:end])
        return float(costs.loading_wait_s(load, self.loaders, compute))

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
                "layers": [{k: v for k, v in asdict(layer).items() if v is not None} for layer in self.layers],
                **({"inputs_s": self.inputs_s, "targets_s": self.targets_s, "both_s": self.both_s}
                   if self.inputs_s or self.targets_s or self.both_s else {}),
                **({"loaders": self.loaders} if self.loaders else {}),
                **({"ties": [{"layers": layers, "bytes": n} for layers, n in self.ties]} if self.ties else {}),
                **({"baseline_bytes": self.baseline_bytes} if self.baseline_bytes else {}),
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
        text = read_text(path, "profile", make, ProfileError)
        if Path(path).suffix == ".json" or text.lstrip()[0] in "{[":
            return Profile.from_dict(parse_json(text, str(path), make, ProfileError), str(path))
        return Profile.from_pipedream(path, text=text)

    @staticmethod
    def from_pipedream(path: str | os.PathLike, batch_size: int = 0, *, text: str | None = None) -> "Profile":
        """Read a profile published with PipeDream (``graph.txt``; format in ``pipetrain/data/pipedream``).

        Layers are the graph's layer nodes in order, and a layer's ``activation_bytes`` the bytes
        crossing the cut after it, as :func:`pipetrain.profiling.graph.read_graph` finds them.

        Args:
            path: the file.
            batch_size: the batch it was profiled at, if known (the file does not say; 0 = unknown).
            text: the file's contents, if already read.

        Raises:
            ProfileError: a malformed file (one line naming it, the line and the fix), edges that form
                a cycle, or several nodes but no edges (the boundary costs would all be zero).
        """
        if text is None:
            text = read_text(path, "profile", _MAKE.format(path=path), ProfileError)
        try:
            graph = read_graph(str(path), text)
        except GraphError as e:
            raise ProfileError(str(e)) from None
        layers = [LayerProfile(f"{n.name} {n.desc}", n.forward_ms / 1e3, n.backward_ms / 1e3, cut, n.parameter_bytes)
                  for n, cut in zip(graph.layers, graph.cut_bytes)]
        return Profile(layers, batch_size, "gpu (PipeDream profile)", Path(path).name.split(".")[0],
                       graph.input_bytes, {"source": "pipedream"})

    @staticmethod
    def from_dict(data: Any, source: str = "profile") -> "Profile":
        """The profile ``data`` holds (the JSON form in the module docstring).

        Raises:
            ProfileError: not a profile of this version, a missing, mistyped or negative field (one
                line naming ``source``, the entry and the field), or no layer taking any time.
        """
        check_header(data, FORMAT, VERSION, source, "`pipetrain profile`", ProfileError)
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
            return Profile(entries, read_field(data, "batch_size", "profile", int),
                           read_field(data, "device", "profile", str), str(data.get("model", "")),
                           read_field(data, "input_bytes", "profile", int, 0), meta,
                           None if setup is None else Setup.from_dict(setup, read_field),
                           **{name: read_field(data, name, "profile", float, 0.0)
                              for name in ("inputs_s", "targets_s", "both_s")},
                           loaders=read_field(data, "loaders", "profile", int, 0),
                           ties=[_tie(k, d, len(entries)) for k, d in enumerate(data.get("ties", []))],
                           baseline_bytes=read_field(data, "baseline_bytes", "profile", int, 0))
        except ValueError as e:
            raise ProfileError(f"{source}: malformed {e}; regenerate it with `pipetrain profile`") from None


def _tie(k: int, entry: Any, layers: int) -> tuple[list[int], int]:
    """Tie entry ``k`` of a profile's JSON: the layers that read one parameter, and its bytes."""
    where = f"tie entry {k}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: {entry!r:.40} is not an object")
    read = entry.get("layers")
    if not isinstance(read, list) or not all(isinstance(i, int) and 0 <= i < layers for i in read):
        raise ValueError(f"{where}: 'layers' is {read!r:.40}, not a list of layer indices")
    return read, read_field(entry, "bytes", where, int)


_MAKE = "`pipetrain profile MODULE:FACTORY --batch-size B -o {path}`"


def _layer(k: int, entry: Any) -> LayerProfile:
    """Layer entry ``k`` of a profile's JSON; ValueError (naming it and the field) if it is malformed."""
    if not isinstance(entry, dict):
        raise ValueError(f"layer entry {k}: {entry!r:.40} is not an object")
    where = f"layer entry {k} ({entry.get('name')!r:.40})"
    return LayerProfile(read_field(entry, "name", where, str), read_field(entry, "forward_s", where, float),
                        read_field(entry, "backward_s", where, float),
                        read_field(entry, "activation_bytes", where, int),
                        read_field(entry, "parameter_bytes", where, int),
                        read_field(entry, "optimizer_s", where, float, 0.0),
                        read_field(entry, "weight_backward_s", where, float) if "weight_backward_s" in entry else None,
                        read_field(entry, "trainable_bytes", where, int) if "trainable_bytes" in entry else None,
                        read_field(entry, "optimizer_bytes", where, int, 0))
