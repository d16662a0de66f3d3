"""Activation recomputation: what a forward run without gradients leaves for its backward to run it again.

With ``recompute=True`` a stage runs each microbatch's forward under ``torch.no_grad`` (its output is
sent on, nothing else is kept but its inputs) and runs it again with gradients right before the
backward. :class:`Replay` makes the second run the first one's exact twin: the same weights (a stashed
version or a tied copy included), the random state the first run started from (CPU, and CUDA on a GPU
worker: dropout draws the same mask; the state the rest of the run sees is put back after), and the
module's buffers as the first run left them (a batch norm's running statistics move once).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.runtime.weights import Weights


def _rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclass
class Replay:
    """What a forward without gradients keeps to be run again: the weights it used (the live ones
    when ``weights`` is the policy's own dict) and the random state it started from."""

    weights: Weights
    rng: tuple[torch.Tensor, torch.Tensor | None]
    device: torch.device

    @classmethod
    def before_forward(cls, weights: Weights, device: torch.device) -> Replay:
        """Taken right before the forward, so the replay starts from the same random state."""
        return cls(weights, _rng(device), device)

    @contextlib.contextmanager
    def replaying(self, module: nn.Module) -> Iterator[None]:
        """Run the block with the forward's random state, then put back the random state and the
        ``module``'s buffers as they were before the block."""
        now = _rng(self.device)
        buffers = [(b, b.clone()) for b in module.buffers()]
        _set_rng(self.rng, self.device)
        try:
            yield
        finally:
            _set_rng(now, self.device)
            with torch.no_grad():
                for b, kept in buffers:
                    b.copy_(kept)
