"""One worker: executes its action list with real tensors. It never decides order; the schedule does."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import Dataset, default_collate

from pipetrain.layers import flatten, unflatten
from pipetrain.runtime.transport import Message, Transport
from pipetrain.runtime.weights import Live
from pipetrain.schedule import Action, Schedule
from pipetrain.strategies.base import GradSync, Weights


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite; training stops and the last checkpoint is kept."""


def epoch_order(n_items: int, batch_size: int, epoch: int, shuffle: bool, seed: int, multiple: int) -> list[list[int]]:
    """Dataset indices of each minibatch of ``epoch``.

    Without shuffling, minibatch t (0-based) is items [t*B, (t+1)*B). The tail that does not fill a
    minibatch, and the minibatches that do not fill a round of every replica (``multiple``), are dropped.
    """
    if shuffle:
        order = torch.randperm(n_items, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    else:
        order = list(range(n_items))
    return [order[t * batch_size:(t + 1) * batch_size] for t in range(per_epoch(n_items, batch_size, multiple))]


def per_epoch(n_items: int, batch_size: int, multiple: int) -> int:
    """Minibatches in an epoch: whole minibatches only, in whole rounds of ``multiple``."""
    return n_items // batch_size // multiple * multiple


@dataclass
class _InFlight:
    """What a (micro)batch leaves at a stage between its forward and its backward."""

    inputs: list[torch.Tensor]
    outputs: Any
    loss: torch.Tensor | None = None
    raw_input: Any = None  # for the naive policy's recompute


@dataclass
class StepRecord:
    step: int
    epoch: int
    loss: float
    samples: int
    samples_per_s: float
    time: float


@dataclass
class Worker:
    """Runs one worker's actions, epoch by epoch.

    Args:
        rank: global rank; ``schedule.stage_of(rank)`` is its stage.
        stage: the module the forward calls (already on ``device``): the stage, or what the
            synchronizer wrapped it in (DDP).
        policy: the weight-version policy (see ``runtime.weights``).
        optimizer: built over ``stage``'s parameters, or None for a stage without any.
        transport: connection to the neighbour stages.
        dataset, loss_fn, batch_size: as given to ``pipetrain.train``.
        grad_sync: the gradient synchronizer the ``A`` and ``S`` actions call, or None (a stage on one
            worker).
        shard: (i, r): take the i-th of r equal consecutive parts of every minibatch (data
            parallelism); (0, 1) takes all of it.
    """

    rank: int
    stage: nn.Module
    policy: Live
    optimizer: torch.optim.Optimizer | None
    transport: Transport
    dataset: Dataset
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch_size: int
    device: torch.device
    grad_sync: GradSync | None = None
    trace: list[tuple[str, float, float]] | None = None
    shard: tuple[int, int] = (0, 1)
    history: list[StepRecord] = field(default_factory=list)
    _flight: dict[tuple[int, int | None], _InFlight] = field(default_factory=dict)
    _inbox: dict[tuple[int, int | None], Message] = field(default_factory=dict)
    _out: dict[tuple[int, int | None], Message] = field(default_factory=dict)
    _losses: dict[int, float] = field(default_factory=dict)
    _collated: dict[tuple[int, int], Any] = field(default_factory=dict)
    _syncing: dict[int, Weights] = field(default_factory=dict)  # mb -> the weights its backward used, until S

    def run_epoch(self, schedule: Schedule, epoch: int, batches: list[list[int]], mb_offset: int,
                  on_step: Callable[[StepRecord], None] | None = None) -> None:
        """Execute this worker's actions for one epoch; minibatch ids are local to the epoch."""
        self._sched, self._batches, self._epoch, self._offset = schedule, batches, epoch, mb_offset
        stage_idx = schedule.stage_of(self.rank)
        self._first, self._last = stage_idx == 0, stage_idx == schedule.num_stages - 1
        self._last_step_t = time.perf_counter()
        for action in schedule.actions[self.rank]:
            t0 = time.perf_counter()
            self._do(action)
            if self.trace is not None:
                self.trace.append((str(action), t0, time.perf_counter()))
            if action.kind == "U" and self._last and on_step is not None:
                on_step(self.history[-1])

    # -- one action ------------------------------------------------------------------------------
    def _do(self, a: Action) -> None:
        key = (a.mb, a.micro)
        peer = self._sched.peer(self.rank, a)
        if a.kind == "RF":
            self._inbox[key] = self.transport.recv(peer, a.mb, a.micro, f"activations of {a}")
        elif a.kind == "RB":
            self._inbox[key] = self.transport.recv(peer, a.mb, a.micro, f"gradients of {a}")
        elif a.kind in ("SF", "SB"):
            self.transport.send(peer, self._out.pop(key))
        elif a.kind == "F":
            self._forward(a)
        elif a.kind == "B":
            self._backward(a)
        elif a.kind == "A":
            self.grad_sync.start(a.mb, self._syncing[a.mb])  # type: ignore[union-attr]
        elif a.kind == "S":
            self.grad_sync.wait(a.mb, self._syncing.pop(a.mb))  # type: ignore[union-attr]
            self.policy.after_backward(a.mb)
        else:
            self._update(a)

    def _micro_slice(self, value: Any, micro: int | None) -> Any:
        m = self._sched.microbatches
        if micro is None or m == 1:
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(v.chunk(m)[micro] for v in value)
        return value.chunk(m)[micro]

    def _batch(self, mb: int, part: int) -> Any:
        """Inputs (part 0) or targets (part 1) of minibatch ``mb``, collated once for all its
        microbatches and kept until its last backward."""
        key = (mb, part)
        if key not in self._collated:
            items = self._batches[mb]
            i, r = self.shard
            size = len(items) // r
            self._collated[key] = default_collate([self.dataset[j][part] for j in items[i * size:(i + 1) * size]])
        return self._collated[key]

    def _forward(self, a: Action) -> None:
        key = (a.mb, a.micro)
        if self._first:
            x, tag = self._micro_slice(_to(self._batch(a.mb, 0), self.device), a.micro), None
            inputs: list[torch.Tensor] = []
        else:
            msg = self._inbox.pop(key)
            tag = msg.version
            inputs = [t.requires_grad_() if t.is_floating_point() else t for t in msg.tensors]
            x = unflatten(inputs, msg.is_tuple)
        weights = self.policy.forward_weights(a.mb, tag)
        with torch.set_grad_enabled(not self.policy.recompute):
            # the live weights are the module's own: call it as is (no reparametrization, hooks intact)
            out = self.stage(x) if weights is self.policy.params else functional_call(self.stage, weights, (x,))
        flight = _InFlight(inputs, out, raw_input=x)
        if self._last:
            target = self._micro_slice(_to(self._batch(a.mb, 1), self.device), a.micro)
            if self.policy.recompute:
                flight.outputs = None
            else:
                flight.loss = self.loss_fn(out, target) / self._sched.microbatches
            flight.raw_input = (x, target)
        else:
            tensors, is_tuple = flatten(out)
            version = self.policy.version if tag is None else tag
            self._out[key] = Message(a.mb, a.micro, version, tensors, is_tuple)
        self._flight[key] = flight

    def _backward(self, a: Action) -> None:
        key = (a.mb, a.micro)
        f = self._flight.pop(key)
        weights = self.policy.backward_weights(a.mb)
        if self.grad_sync is not None:
            self.grad_sync.watch(weights)
            self._syncing[a.mb] = weights
        if self.policy.recompute:  # naive: forward again with the weights current now
            x = f.raw_input[0] if self._last else f.raw_input
            out = functional_call(self.stage, weights, (x,))
            if self._last:
                f.loss = self.loss_fn(out, f.raw_input[1]) / self._sched.microbatches
            f.outputs = out
        if self._last:
            loss = f.loss
            assert loss is not None
            value = float(loss.detach()) * self._sched.microbatches
            if not math.isfinite(value):
                raise NonFiniteLoss(f"loss is {value} at epoch {self._epoch} minibatch {a.mb}")
            self._losses[a.mb] = self._losses.get(a.mb, 0.0) + value / self._sched.microbatches
            loss.backward()
        else:
            grads = self._inbox.pop(key).tensors
            outs = [t for t in flatten(f.outputs)[0] if t.is_floating_point()]
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not self._first:
            floats = [t for t in f.inputs if t.is_floating_point()]
            grads_in = [torch.zeros_like(t) if t.grad is None else t.grad for t in floats]
            self._out[key] = Message(a.mb, a.micro, 0, grads_in, False)
        last_micro = a.micro is None or a.micro == self._sched.microbatches - 1
        if last_micro:
            self._collated.pop((a.mb, 0), None)
            self._collated.pop((a.mb, 1), None)
        if last_micro and self.grad_sync is None:  # else at the S action, once the sync is done
            self.policy.after_backward(a.mb)

    def _update(self, a: Action) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        r = self._sched.replicas[self._sched.stage_of(self.rank)]
        self.policy.updated(r)
        if self._last:
            # one record per minibatch: a replica of the output stage records its own minibatches
            now = time.perf_counter()
            self.history.append(StepRecord(self._offset + a.mb + 1, self._epoch, self._losses.pop(a.mb),
                                           self.batch_size, self.batch_size / max(now - self._last_step_t, 1e-9),
                                           now))
            self._last_step_t = now


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return type(value)(_to(v, device) for v in value)
