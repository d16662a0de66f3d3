"""A data-parallel strategy on one worker: nothing to agree on, so nothing is copied or sent.

[Note: one worker] The mean of one worker's gradient is that gradient, bit for bit (a sum of one
term, divided by 1), so ``ddp``, ``pipe-sgd`` and ``cgdp`` on one worker train exactly as their
synchronizers would, without them: no DDP reducer copying every gradient into buckets and back, no
communication thread, no flat copy, no shared host memory. What is left is the strategy's update
rule, which the schedule carries: Pipe-SGD's ``A t`` comes K-1 backwards before ``S t``, so the
gradient of ``t`` is set aside at ``A`` (the tensors themselves, not a copy) while the next backwards
make their own, and is put back at ``S`` for the ``U t`` step. A parameter the backward gave no
gradient gets zeros, as every synchronizer's sum gives it.
"""
from __future__ import annotations

import torch

from pipetrain.strategies.base import GradSync, Weights


class OneWorker(GradSync):
    """The synchronizer of a data-parallel strategy on one worker (see [Note: one worker])."""

    def __init__(self) -> None:
        self._aside: dict[int, list[torch.Tensor | None]] = {}  # mb -> its gradients, between A and S

    def start(self, mb: int, weights: Weights) -> None:
        """Set ``mb``'s gradients aside; ``.grad`` is free for the next backward."""
        params = [p for p in weights.values() if p.requires_grad]
        self._aside[mb] = [p.grad for p in params]
        for p in params:
            p.grad = None

    def wait(self, mb: int, weights: Weights) -> None:
        """Put ``mb``'s gradients back on ``.grad`` (zeros where the backward gave none)."""
        params = [p for p in weights.values() if p.requires_grad]
        for p, g in zip(params, self._aside.pop(mb)):
            p.grad = torch.zeros_like(p) if g is None else g
