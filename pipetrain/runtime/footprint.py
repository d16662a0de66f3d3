"""What a stage keeps between a microbatch's forward and its backward, counted as the run goes.

Activation bytes are the tensors autograd saves for the backward (counted by
``torch.autograd.graph.saved_tensors_hooks`` while the forward runs: each saved tensor's
``numel * element_size`` once, however often it is saved; the stage's weights, which autograd also
saves, are not activations and are left out) plus the stage's received inputs. With ``recompute``, a
microbatch in flight keeps its inputs only, and its backward holds one microbatch's full activations
again while it runs. Weight bytes are the stashed weight versions the policy holds
(:meth:`pipetrain.runtime.weights.Live.stashed_bytes`) and the copies of tied parameters
(:meth:`pipetrain.runtime.tied.TiedCopies.stashed_bytes`). Peaks are over the whole run.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Saved:
    """The bytes autograd saved while a :func:`saved` block ran (its weights left out)."""

    nbytes: int = 0
    _seen: set[tuple[int, int, Any]] = field(default_factory=set)


@contextlib.contextmanager
def saved(weights: Iterable[torch.Tensor], also: Iterable[torch.Tensor] = ()) -> Iterator[Saved]:
    """Count the bytes of the tensors autograd saves inside the block, each once, other than ``weights``;
    ``also`` (a stage's kept inputs) count as saved whether autograd saves them or not."""
    skip = {t.data_ptr() for t in weights}
    counted = Saved()

    def add(t: torch.Tensor) -> None:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.data_ptr() not in skip and key not in counted._seen:
            counted._seen.add(key)
            counted.nbytes += t.numel() * t.element_size()

    for t in also:
        add(t)

    def pack(t: torch.Tensor) -> torch.Tensor:
        add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counted


@dataclass
class Footprint:
    """A worker's stashed bytes now and at their peak; ``samples`` (when tracing) records
    ``(perf_counter, activation bytes, weight bytes)`` at every change."""

    activation_bytes: int = 0
    weight_bytes: int = 0
    peak_activation_bytes: int = 0
    peak_weight_bytes: int = 0
    samples: list[tuple[float, int, int]] | None = None
    _held: dict[Any, int] = field(default_factory=dict)

    def hold(self, key: Any, nbytes: int, now: float) -> None:
        """Microbatch ``key`` keeps ``nbytes`` until :meth:`release`."""
        self._held[key] = nbytes
        self.activation_bytes += nbytes
        self._note(now, self.activation_bytes)

    def rerun(self, nbytes: int, now: float) -> None:
        """A recompute holds ``nbytes`` more while its backward runs."""
        self._note(now, self.activation_bytes + nbytes)

    def release(self, key: Any, now: float) -> None:
        self.activation_bytes -= self._held.pop(key, 0)
        self._note(now, self.activation_bytes)

    def weights(self, nbytes: int, now: float) -> None:
        """The stashed weight versions now take ``nbytes``."""
        if nbytes != self.weight_bytes:
            self.weight_bytes = nbytes
            self._note(now, self.activation_bytes)

    def report(self) -> dict[str, int]:
        return {"activation_bytes": self.peak_activation_bytes, "weight_bytes": self.peak_weight_bytes}

    def _note(self, now: float, activations: int) -> None:
        self.peak_activation_bytes = max(self.peak_activation_bytes, activations)
        self.peak_weight_bytes = max(self.peak_weight_bytes, self.weight_bytes)
        if self.samples is not None:
            self.samples.append((now, activations, self.weight_bytes))
