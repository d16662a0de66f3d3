"""One worker: executes its action list with real tensors. It never decides order; the schedule does."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from pipetrain.batches import call, microbatch, shapes_of, tensors_of, to_device
from pipetrain.errors import PipetrainError, one_line
from pipetrain.layers import flatten, received, unflatten
from pipetrain.runtime.footprint import Footprint, saved
from pipetrain.runtime.recompute import Replay
from pipetrain.runtime.tied import TiedCopies
from pipetrain.runtime.loader import LoadError, Source, Task
from pipetrain.runtime.logs import JsonLines, MetricsLog
from pipetrain.runtime.split_backward import WeightBackward, fused_backward, input_backward
from pipetrain.runtime.transport import Channel, Message
from pipetrain.runtime.weights import Live
from pipetrain.schedule import Action, Schedule
from pipetrain.strategies.base import GradSync, Weights


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite, or diverged; training stops and the last checkpoint is kept."""


class StageError(RuntimeError):
    """The user's model, loss or data failed inside a worker; the message says which worker and minibatch."""


DIVERGED = 1e4
"""A loss whose magnitude grows past this many times its first value (or 1) has diverged."""


@dataclass
class _InFlight:
    """What a (micro)batch leaves at a stage between its forward and its backward."""

    inputs: list[torch.Tensor]
    outputs: Any
    loss: torch.Tensor | None = None
    raw_input: Any = None  # the forward's input, (input, target) at the output stage: what a rerun runs on
    replay: Replay | None = None  # recompute: what the rerun repeats


@dataclass
class StepRecord:
    """One optimizer update, as ``TrainResult.history`` lists it; ``attempt`` counts the restarts
    before the run that made it, ``lr`` is the first parameter group's learning rate the update used,
    and ``eval`` the evaluation after the epoch this update ended (``loss`` and each metric), if any."""

    step: int
    epoch: int
    loss: float
    samples: int
    samples_per_s: float
    time: float
    attempt: int = 0
    lr: float | None = None
    eval: dict[str, float] | None = None


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
        source: where its minibatches come from (:mod:`pipetrain.runtime.loader`).
        loss_fn, batch_size: as given to ``pipetrain.train``.
        grad_sync: the gradient synchronizer the ``A`` and ``S`` actions call, or None (a stage on one
            worker).
        shard: (i, r): take the i-th of r equal consecutive parts of every minibatch (data
            parallelism); (0, 1) takes all of it.
        name: how errors name this worker (e.g. ``"stage 1 (rank 1)"``).
        attempt: restarts before this run, recorded in the history.
        log: where each history record is also appended (JSON lines), or None.
        scheduler: the learning-rate scheduler stepped after every update, or None.
        clip_grad_norm: before every update, scale this worker's gradients (its stage's, after any
            sync) down to this norm at most; None leaves them.
        precision: ``"bf16"`` runs forwards and the loss under autocast to bfloat16.
        metrics_log: where it logs updates in the user's ``log_dir`` (:mod:`pipetrain.runtime.logs`), or None.
        tied: the stage's copies of parameters other stages also read, or None.
        fixed_shapes: every minibatch must have the first one's shapes (a pipeline's stages are made for
            them); data parallelism takes any.
        recompute: keep only a microbatch's inputs between its forward (run without gradients) and its
            backward, which runs the forward again first (:mod:`pipetrain.runtime.recompute`).
        footprint: the bytes it keeps for backwards (:mod:`pipetrain.runtime.footprint`).
        compiled: the stage runs through ``torch.compile`` (:mod:`pipetrain.runtime.compiled`): a split
            backward takes both parts at ``I`` (:func:`~pipetrain.runtime.split_backward.fused_backward`).
    """

    rank: int
    stage: nn.Module
    policy: Live
    optimizer: torch.optim.Optimizer | None
    transport: Channel
    source: Source
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch_size: int
    device: torch.device
    grad_sync: GradSync | None = None
    trace: list[tuple[str, float, float]] | None = None
    shard: tuple[int, int] = (0, 1)
    name: str = "worker"
    attempt: int = 0
    log: JsonLines | None = None
    scheduler: Any = None
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    metrics_log: MetricsLog | None = None
    tied: TiedCopies | None = None
    fixed_shapes: bool = True
    recompute: bool = False
    footprint: Footprint = field(default_factory=Footprint)
    compiled: bool = False
    history: list[StepRecord] = field(default_factory=list)
    _flight: dict[tuple[int, int | None], _InFlight] = field(default_factory=dict)
    _inbox: dict[tuple[int, int | None], Message] = field(default_factory=dict)
    _out: dict[tuple[int, int | None], Message] = field(default_factory=dict)
    _losses: dict[int, float] = field(default_factory=dict)
    _collated: dict[tuple[int, int], Any] = field(default_factory=dict)
    _syncing: dict[int, Weights] = field(default_factory=dict)  # mb -> the weights its backward used, until S
    _weight_parts: dict[tuple[int, int | None], WeightBackward] = field(default_factory=dict)  # I done, W to come
    _shapes: dict[int, Any] = field(default_factory=dict)  # part -> the shapes of the first minibatch's part
    _first_loss: float | None = None
    _scores: list[float] | None = None  # while evaluating: loss and metric sums over samples, then the count
    _metrics: dict[str, Callable[[Any, Any], Any]] = field(default_factory=dict)

    def run_epoch(self, schedule: Schedule, epoch: int, batches: list[list[int]], mb_offset: int,
                  on_step: Callable[[StepRecord], None] | None = None) -> None:
        """Execute this worker's actions for one epoch; minibatch ids are local to the epoch."""
        self.begin_epoch(schedule, epoch, batches, mb_offset)
        for action in schedule.actions[self.rank]:
            self.step(action, on_step)
        if self.tied is not None:
            self.tied.finish(self.policy.version)

    def begin_epoch(self, schedule: Schedule, epoch: int, batches: list[list[int]], mb_offset: int) -> None:
        """Get ready to run ``schedule``'s actions of this worker for one epoch, one :meth:`step` each."""
        self._sched, self._batches, self._epoch, self._offset = schedule, batches, epoch, mb_offset
        stage_idx = schedule.stage_of(self.rank)
        self._first, self._last = stage_idx == 0, stage_idx == schedule.num_stages - 1
        self.source.begin(self._tasks(schedule, batches, epoch, False))
        self.policy.begin(schedule.replicas[stage_idx])
        self._last_step_t = time.perf_counter()

    def step(self, action: Action, on_step: Callable[[StepRecord], None] | None = None) -> None:
        """Execute one action of the epoch :meth:`begin_epoch` began."""
        t0 = time.perf_counter()
        self._do(action)
        if self.trace is not None:
            self.trace.append((str(action), t0, time.perf_counter()))
        if action.kind == "U" and self._last and on_step is not None:
            on_step(self.history[-1])

    def evaluate(self, schedule: Schedule, batches: list[list[int]],
                 metrics: dict[str, Callable[[Any, Any], Any]]) -> list[float]:
        """Run a forward-only ``schedule`` over ``batches`` of the evaluation dataset with the live
        weights, in eval mode and without gradients; return this worker's sums over its samples of the
        loss and of each metric, then its sample count (zeros but at the output stage)."""
        with self.evaluating(schedule, batches, metrics) as scores:
            for action in schedule.actions[self.rank]:
                self._do(action)
        return scores

    @contextlib.contextmanager
    def evaluating(self, schedule: Schedule, batches: list[list[int]],
                   metrics: dict[str, Callable[[Any, Any], Any]]) -> Iterator[list[float]]:
        """Inside it, :meth:`step` runs ``schedule``'s evaluation actions as :meth:`evaluate` does; it
        yields the sums, filled in as they run."""
        saved = (self._sched, self._batches, self._collated)
        self._sched, self._batches, self._collated = schedule, batches, {}
        self._first, self._last = schedule.stage_of(self.rank) == 0, schedule.stage_of(self.rank) == schedule.num_stages - 1
        self.source.begin(self._tasks(schedule, batches, self._epoch, True))
        self._scores, self._metrics = [0.0] * (len(metrics) + 2), metrics
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad():
                yield self._scores
        finally:
            self.stage.train(was_training)
            self._sched, self._batches, self._collated = saved
            self._scores = None

    def _evaluate_forward(self, a: Action, x: Any) -> None:
        """An evaluation forward: the output stage adds up the loss and metrics; others send on."""
        with self._autocast(), self._blame(f"the evaluation forward of minibatch {a.mb}"):
            out = call(self.stage, x)
        if not self._last:
            tensors, is_tuple = flatten(out)
            self._out[(a.mb, a.micro)] = Message(a.mb, a.micro, self.policy.version, tensors, is_tuple)
            return
        assert self._scores is not None
        m = self._sched.microbatches
        target = microbatch(to_device(self._batch(a.mb, 1), self.device), a.micro, m)
        with self._autocast():
            values = [self._loss(out, target, a.mb)]
        for name, metric in self._metrics.items():
            with self._blame(f"metric {name!r} on minibatch {a.mb}"):
                values.append(metric(out, target))
        n = len(self._batches[a.mb]) // self.shard[1] // m
        for i, v in enumerate(values):
            self._scores[i] += float(v) * n
        self._scores[-1] += n
        if a.micro in (None, m - 1):
            self._collated.pop((a.mb, 0), None)
            self._collated.pop((a.mb, 1), None)

    def _autocast(self) -> Any:
        """Autocast to bfloat16 with ``precision="bf16"``; nothing otherwise."""
        if self.precision != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # -- one action ------------------------------------------------------------------------------
    def _do(self, a: Action) -> None:
        key = (a.mb, a.micro)
        if a.kind in ("RF", "RB", "SF", "SB"):
            peer = self._sched.peer(self.rank, a)
            assert peer is not None, f"{a} on worker {self.rank} has no peer"  # sends and receives always have one
            if a.kind == "RF":
                self._inbox[key] = self.transport.recv(peer, a.mb, a.micro, f"activations of {a}")
            elif a.kind == "RB":
                self._inbox[key] = self.transport.recv(peer, a.mb, a.micro, f"gradients of {a}")
            else:
                self.transport.send(peer, self._out.pop(key))
        elif a.kind == "F":
            self._forward(a)
        elif a.kind in ("B", "I"):
            self._backward(a)
        elif a.kind == "W":
            with self._blame(f"the weight gradient of minibatch {a.mb}"):
                self._weight_parts.pop((a.mb, a.micro)).run()
            self._backward_done(a)
        elif a.kind == "A":
            assert self.grad_sync is not None, f"{a} on worker {self.rank}, which has no gradient synchronizer"
            self.grad_sync.start(a.mb, self._syncing[a.mb])
        elif a.kind == "S":
            assert self.grad_sync is not None, f"{a} on worker {self.rank}, which has no gradient synchronizer"
            self.grad_sync.wait(a.mb, self._syncing.pop(a.mb))
            self.policy.after_backward(a.mb)
        else:
            self._update(a)

    def _tasks(self, schedule: Schedule, batches: list[list[int]], epoch: int, evaluating: bool) -> list[Task]:
        """The minibatches this worker will build, in the order its forwards need them: its shard of
        each, the parts it uses (a worker that needs both fetches each item once); none in a middle stage."""
        parts = self._parts
        if not parts or not batches:
            return []
        i, r = self.shard
        size = len(batches[0]) // r  # every minibatch is whole
        order = dict.fromkeys(a.mb for a in schedule.actions[self.rank] if a.kind == "F")
        return [Task(mb, tuple(batches[mb][i * size:(i + 1) * size]), parts, epoch, evaluating) for mb in order]

    @property
    def _parts(self) -> tuple[int, ...]:
        """The parts of each minibatch this worker uses: inputs (0) on the first stage, targets (1) on the last."""
        return (0,) * self._first + (1,) * self._last

    def _batch(self, mb: int, part: int) -> Any:
        """Inputs (part 0) or targets (part 1) of minibatch ``mb``, collated once for all its
        microbatches and kept until its last backward."""
        key = (mb, part)
        if key not in self._collated:
            parts = self._parts
            with self._blame(f"collating the dataset's items into minibatch {mb}"):
                try:
                    values = self.source.get(mb)
                except LoadError as e:
                    raise StageError(f"{self.name}: {e}") from e
            for p, value in zip(parts, values):
                if self.fixed_shapes:
                    self._check_shapes(mb, p, value)
                self._collated[(mb, p)] = value
        return self._collated[key]

    def _check_shapes(self, mb: int, part: int, value: Any) -> None:
        """A pipeline's minibatches all have the first one's shapes, or a StageError says to pad."""
        shapes = shapes_of(value)
        first = self._shapes.setdefault(part, shapes)
        if shapes != first:
            what = "inputs" if part == 0 else "targets"
            raise StageError(f"{self.name}: minibatch {mb}'s {what} have shape {shapes} but the first minibatch's "
                             f"had {first}; a pipeline runs every minibatch in the first one's shapes: give every "
                             "item the same shape (pad or resize; text: pad to one fixed length, e.g. "
                             "padding='max_length' in the tokenizer or DataCollatorWithPadding)")

    def _forward(self, a: Action) -> None:
        key = (a.mb, a.micro)
        if self._first:
            x, tag = microbatch(to_device(self._batch(a.mb, 0), self.device), a.micro, self._sched.microbatches), None
            inputs: list[torch.Tensor] = []
        else:
            msg = self._inbox.pop(key)
            tag = msg.version
            inputs, fed = received(msg.tensors, self._scores is None)
            x = unflatten(fed, msg.is_tuple)
        if self._scores is not None:
            return self._evaluate_forward(a, x)
        weights = self.policy.forward_weights(a.mb, tag)
        if self.tied is not None:
            weights = {**weights, **self.tied.weights(a.mb, self.policy.version_of(a.mb, tag))}
        replay = Replay.before_forward(weights, self.device) if self.recompute else None
        rerun = self.policy.recompute or self.recompute
        kept = inputs if inputs or not rerun else tensors_of(x)
        with torch.set_grad_enabled(not rerun), saved(weights.values(), kept) as held:
            out = self._run(x, weights, a.mb)
        # a rerun copies received inputs from their leaves afresh: keep the leaves, not this forward's copies
        raw = unflatten(inputs, isinstance(x, tuple)) if inputs and rerun else x
        flight = _InFlight(inputs, None if rerun else out, raw_input=raw, replay=replay)
        if self._last:
            target = microbatch(to_device(self._batch(a.mb, 1), self.device), a.micro, self._sched.microbatches)
            if not rerun:
                with saved(weights.values()) as more:
                    flight.loss = self._micro_loss(out, target, a.mb)
                held.nbytes += more.nbytes
            flight.raw_input = (x, target)
        else:
            tensors, is_tuple = flatten(out)
            self._out[key] = Message(a.mb, a.micro, self.policy.version_of(a.mb, tag), tensors, is_tuple)
        self._flight[key] = flight
        now = time.perf_counter()
        self.footprint.hold(key, held.nbytes, now)
        self.footprint.weights(self._weight_bytes(), now)

    def _weight_bytes(self) -> int:
        """Stashed weight versions, and the tied parameters' copies."""
        return self.policy.stashed_bytes() + (self.tied.stashed_bytes() if self.tied is not None else 0)

    def _run(self, x: Any, weights: Weights, mb: int) -> Any:
        """The stage's forward on ``x`` with ``weights`` (under autocast with bf16)."""
        with self._autocast(), self._blame(f"the forward of minibatch {mb}"):
            # the live weights are the module's own: call it as is (no reparametrization, hooks intact)
            return call(self.stage, x) if weights is self.policy.params else call(self.stage, x, weights)

    def _rerun(self, f: _InFlight, a: Action, weights: Weights) -> None:
        """Run a forward again, with gradients, right before its backward: with the weights and random
        state of the first run (recompute), or with ``weights``, the current ones (the naive policy)."""
        x = f.raw_input[0] if self._last else f.raw_input
        if f.inputs:  # a received input: fresh copies of its leaves, as the forward ran on
            x = unflatten([t.clone() for t in f.inputs], isinstance(x, tuple))
        if f.replay is not None:
            weights = f.replay.weights
        again = f.replay.replaying(self.stage) if f.replay is not None else contextlib.nullcontext()
        with again, saved(weights.values()) as held:
            f.outputs = self._run(x, weights, a.mb)
            if self._last:
                f.loss = self._micro_loss(f.outputs, f.raw_input[1], a.mb)
        self.footprint.rerun(held.nbytes, time.perf_counter())

    def _micro_loss(self, out: Any, target: Any, mb: int) -> torch.Tensor:
        """A microbatch's share of the minibatch's loss (under autocast with bf16); a whole minibatch's
        loss is not divided by 1, which would add an operation to its forward and backward and change
        no bit of either."""
        m = self._sched.microbatches
        with self._autocast():
            loss = self._loss(out, target, mb)
            return loss / m if m > 1 else loss

    def _backward(self, a: Action) -> None:
        """A whole backward (``B``), or its input-gradient part (``I``), whose weight-gradient part
        (:mod:`pipetrain.runtime.split_backward`) waits for the ``W`` action."""
        key = (a.mb, a.micro)
        f = self._flight.pop(key)
        weights = self.policy.backward_weights(a.mb)
        if self.grad_sync is not None:
            self.grad_sync.watch(weights, final=a.micro in (None, self._sched.microbatches - 1))
            self._syncing[a.mb] = weights
        if self.policy.recompute or f.replay is not None:
            self._rerun(f, a, weights)
        if self._last:
            loss = f.loss
            assert loss is not None
            value = float(loss.detach()) * self._sched.microbatches
            self._check_loss(value, a.mb)
            self._losses[a.mb] = self._losses.get(a.mb, 0.0) + value / self._sched.microbatches
            pairs = [(loss, torch.ones_like(loss))]
        else:
            grads = self._inbox.pop(key).tensors
            outs = [t for t in flatten(f.outputs)[0] if t.is_floating_point()]
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        floats = [t for t in f.inputs if t.is_floating_point()]
        with self._blame(f"the backward of minibatch {a.mb}"):
            if a.kind == "I":
                split = fused_backward if self.compiled else input_backward
                got, self._weight_parts[key] = split([o for o, _ in pairs], [g for _, g in pairs], floats)
            else:
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                got = [t.grad for t in floats]
        if not self._first:
            grads_in = [torch.zeros_like(t) if g is None else g for t, g in zip(floats, got)]
            self._out[key] = Message(a.mb, a.micro, 0, grads_in, False)
        if a.kind == "B":
            self._backward_done(a)

    def _backward_done(self, a: Action) -> None:
        """After a microbatch's whole backward (or its ``W``): the weights' gradients are complete and
        what it held is let go."""
        self.footprint.release((a.mb, a.micro), time.perf_counter())
        last_micro = a.micro is None or a.micro == self._sched.microbatches - 1
        if last_micro:
            if self.tied is not None:
                self.tied.take_gradient(a.mb)
            self._collated.pop((a.mb, 0), None)
            self._collated.pop((a.mb, 1), None)
        if last_micro and self.grad_sync is None:  # else at the S action, once the sync is done
            self.policy.after_backward(a.mb)

    @contextlib.contextmanager
    def _blame(self, what: str) -> Iterator[None]:
        """Name this worker and ``what`` it was doing in an error of the user's model."""
        try:
            yield
        except (StageError, NonFiniteLoss, PipetrainError):  # ours already say where (a stage not compiled)
            raise
        except Exception as e:  # the user's code may raise anything
            raise StageError(f"{self.name}: {what} failed: {one_line(e)}") from e

    def _loss(self, out: Any, target: Any, mb: int) -> torch.Tensor:
        """``loss_fn(out, target)``, which must be a scalar; errors say what the model gave it."""
        try:
            loss = self.loss_fn(out, target)
        except Exception as e:  # the user's loss may raise anything
            raise StageError(f"{self.name}: loss_fn(output, target) failed on minibatch {mb}: {one_line(e)} "
                             f"(the model returned {_describe(out)}, the target is "
                             f"{_describe(target)})") from e
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise StageError(f"{self.name}: loss_fn returned {_describe(loss)} for minibatch {mb}, not a scalar "
                             "tensor; reduce it (e.g. reduction='mean')")
        return loss

    def _check_loss(self, value: float, mb: int) -> None:
        """Stop on a NaN or infinite loss, or one that diverged from its first value."""
        if not math.isfinite(value):
            raise NonFiniteLoss(f"loss is {value} at epoch {self._epoch} minibatch {mb}")
        if self._first_loss is None:
            self._first_loss = value
        if abs(value) > DIVERGED * max(abs(self._first_loss), 1.0):
            raise NonFiniteLoss(f"loss diverged: {value:.3g} at epoch {self._epoch} minibatch {mb}, from "
                                f"{self._first_loss:.3g} at the start (is the loss right for these targets?)")

    def _update(self, a: Action) -> None:
        lr = None
        if self.tied is not None:
            self.tied.before_update()
        if self.optimizer is not None:
            if self.clip_grad_norm is not None:
                params = [p for group in self.optimizer.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            lr = float(self.optimizer.param_groups[0]["lr"])
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()
        r = self._sched.replicas[self._sched.stage_of(self.rank)]
        self.policy.updated(r)
        if self.tied is not None:
            self.tied.after_update(self.policy.version)
        self.footprint.weights(self._weight_bytes(), time.perf_counter())
        if self._last:
            # one record per minibatch: a replica of the output stage records its own minibatches
            now = time.perf_counter()
            record = StepRecord(self._offset + a.mb + 1, self._epoch, self._losses.pop(a.mb), self.batch_size,
                                self.batch_size / max(now - self._last_step_t, 1e-9), now, self.attempt, lr)
            self.history.append(record)
            if self.log is not None or self.metrics_log is not None:
                fields = dict(vars(record))  # its fields are scalars (eval comes later): no deep copy
                if self.log is not None:
                    self.log.append(fields)
                if self.metrics_log is not None:
                    self.metrics_log.update(fields)
            self._last_step_t = now


def _describe(value: Any) -> str:
    """A value in a few words: a tensor's shape and dtype, else its type."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({str(value.dtype).removeprefix('torch.')})"
    return f"a {type(value).__name__}"
