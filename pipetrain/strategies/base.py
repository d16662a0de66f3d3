"""The one small interface every gradient synchronizer implements, and what it is built from.

A worker meets its synchronizer at three points of its action list (see
:mod:`pipetrain.schedule.actions`): before each backward (``watch``: hooks that start syncing while
autograd runs), at ``A`` (``start``: the minibatch's gradient is complete) and at ``S`` (``wait``: after
it, the agreed gradient of that minibatch is on ``.grad`` of the weights, ready for the ``U`` step).
The worker does not know which strategy runs, and the simulator prices the same actions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SyncContext:
    """What a strategy needs to build this worker's synchronizer.

    Attributes:
        rank: this worker's global rank.
        replicas: workers per stage; data parallelism is one stage on every worker.
        device: where gradients live.
        timeout: seconds to wait for a sync before declaring a peer silent.
        compression: the codec name inside the strategy's own ring allreduce, or None.
        stage: this worker's stage.
    """

    rank: int
    replicas: tuple[int, ...]
    device: torch.device
    timeout: float
    compression: str | None = None
    stage: int = 0


class GradSync:
    """Agrees on a gradient among the workers of a stage; the base class does nothing.

    Attributes:
        bytes_sent: payload bytes this worker sent to sync gradients (counted or estimated, as each
            synchronizer says).
    """

    bytes_sent: int = 0

    def wrap(self, module: nn.Module) -> nn.Module:
        """The module the worker calls (a synchronizer may wrap it, as DDP does)."""
        return module

    def watch(self, weights: Weights) -> None:
        """Called before a backward with the weights it will use."""

    def start(self, mb: int, weights: Weights) -> None:
        """At ``A``: minibatch ``mb``'s gradient is complete on ``weights``' ``.grad``."""

    def wait(self, mb: int, weights: Weights) -> None:
        """At ``S``: return once ``mb``'s agreed (mean) gradient is on ``weights``' ``.grad``."""

    def close(self) -> None:
        """Release threads and buffers; called once after the last epoch."""
