"""Per-layer profiles: plain, versioned, serializable data.

A profile is taken on a stated device at a stated minibatch size. For layer k it holds the forward and
backward seconds, the bytes of every tensor crossing the cut after layer k (what layer k's stage would
send to the next stage, and receive back as gradients), and the layer's parameter bytes.

JSON form (``version`` 1)::

    {"format": "pipetrain-profile", "version": 1, "model": "...", "device": "cpu",
     "batch_size": 32, "input_bytes": 8192,
     "layers": [{"name": "0", "forward_s": 0.001, "backward_s": 0.002,
                 "activation_bytes": 4096, "parameter_bytes": 1024}, ...]}
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass
class Profile:
    """Every layer of a model, in order, measured at ``batch_size`` on ``device``."""

    layers: list[LayerProfile]
    batch_size: int
    device: str
    model: str = ""
    input_bytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "device": self.device,
                "batch_size": self.batch_size, "input_bytes": self.input_bytes, "meta": self.meta,
                "layers": [asdict(layer) for layer in self.layers]}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def from_dict(data: dict[str, Any], source: str = "profile") -> "Profile":
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ProfileError(f"{source}: not a {FORMAT} version {VERSION} file; make one with "
                               "`pipetrain profile` or read PipeDream files with Profile.from_pipedream")
        try:
            layers = [LayerProfile(str(d["name"]), float(d["forward_s"]), float(d["backward_s"]),
                                   int(d["activation_bytes"]), int(d["parameter_bytes"])) for d in data["layers"]]
            return Profile(layers, int(data["batch_size"]), str(data["device"]), str(data.get("model", "")),
                           int(data.get("input_bytes", 0)), dict(data.get("meta", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{source}: malformed layer entry ({e}); regenerate it with `pipetrain profile`") from None
