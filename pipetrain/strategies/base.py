"""The one small interface every gradient synchronizer implements, and what it is built from.

A worker meets its synchronizer at three points of its action list (see
:mod:`pipetrain.schedule.actions`): before each backward (``watch``: hooks that start syncing while
autograd runs), at ``A`` (``start``: the minibatch's gradient is complete) and at ``S`` (``wait``: after
it, the agreed gradient of that minibatch is on ``.grad`` of the weights, ready for the ``U`` step).
The worker does not know which strategy runs, and the simulator prices the same actions.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.errors import one_line
from pipetrain.layout import Layout

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SyncContext:
    """What a strategy needs to build this worker's synchronizer.

    Attributes:
        rank: this worker's global rank.
        layout: the workers of each stage; data parallelism is one stage on every worker.
        device: where gradients live.
        timeout: seconds to wait for a sync before declaring a peer silent.
    """

    rank: int
    layout: Layout
    device: torch.device
    timeout: float

    @property
    def stage(self) -> int:
        """This worker's stage."""
        return self.layout.stage_of(self.rank)


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

    def watch(self, weights: Weights, final: bool = True) -> None:
        """Called before a backward with the weights it will use; ``final``: the backward of a minibatch's
        last microbatch (an earlier one only adds its part to the gradient)."""

    def start(self, mb: int, weights: Weights) -> None:
        """At ``A``: minibatch ``mb``'s gradient is complete on ``weights``' ``.grad``."""

    def wait(self, mb: int, weights: Weights) -> None:
        """At ``S``: return once ``mb``'s agreed (mean) gradient is on ``weights``' ``.grad``."""

    def close(self) -> None:
        """Release threads and buffers; called once after the last epoch."""

    def stats(self) -> dict[str, Any]:
        """What this synchronizer measured or decided, as plain data (``TrainResult.sync_stats``)."""
        return {}


class SyncError(RuntimeError):
    """A gradient sync failed or did not finish in time: a peer died or went silent."""


class Mailbox:
    """What a communication thread hands to the compute thread, by key; its failure ends every wait.

    Args:
        timeout: seconds :meth:`take` waits for one key before giving up.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._items: dict[Any, Any] = {}
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def put(self, key: Any, value: Any) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The communication thread died of ``error``; every waiter raises."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def ready(self, key: Any) -> bool:
        with self._cond:
            return key in self._items

    def take(self, key: Any, what: str) -> Any:
        """Wait for ``key`` and remove it.

        Raises:
            SyncError: the communication thread failed, or nothing came within the timeout; the
                message names ``what`` was awaited.
        """
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while key not in self._items:
                if self._error is not None:
                    raise SyncError(f"{what} failed ({one_line(self._error)}): "
                                    "a worker died or went silent")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SyncError(f"{what} did not finish within {self.timeout:g}s: a worker died or went silent")
                self._cond.wait(min(left, 1.0))
            return self._items.pop(key)
