"""A process that holds several stages (a looped schedule such as ``interleaved-1f1b``).

Each stage keeps its own :class:`~pipetrain.runtime.worker.Worker` (module, optimizer, what is in
flight), built as if the stage had a worker of its own, with the stage index as its rank. The process
walks its one action list in order and hands each action to the Worker of the action's stage; an
update without a stage goes to every Worker. The Workers share the process's transport through a
:class:`StageChannel`, which sends to the process holding the peer stage and keys each message by the
stage boundary it crosses: a boundary's activations and gradients go between two fixed processes, so
(process, boundary, minibatch, microbatch) names one message.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pipetrain.runtime.logs import MetricsLog
from pipetrain.runtime.transport import Message, Transport
from pipetrain.runtime.worker import StepRecord, Worker
from pipetrain.schedule import Action, Schedule


def edges(stages: int, workers: int) -> list[tuple[int, int]]:
    """The directed process pairs that exchange activations or gradients, stage s on process s mod W."""
    return sorted({pair for s in range(stages - 1)
                   for pair in ((s % workers, (s + 1) % workers), ((s + 1) % workers, s % workers))})


def stage_view(schedule: Schedule) -> Schedule:
    """``schedule`` as if each stage had a worker of its own (rank = stage): the actions of each stage,
    without their stage, an update of its worker included; what each stage's Worker reads."""
    assert schedule.looped is not None
    lists = [tuple(a.local() for a in schedule.actions[schedule.first_worker(s)] if a.stage in (None, s))
             for s in range(schedule.num_stages)]
    return Schedule(schedule.name, schedule.replicas, tuple(lists), schedule.microbatches, schedule.noam)


class StageChannel:
    """The :class:`~pipetrain.runtime.transport.Channel` of the Worker of ``stage``: its peers are
    stages, each held by process stage mod ``workers``."""

    def __init__(self, transport: Transport, stage: int, workers: int) -> None:
        self.transport, self.stage, self.workers = transport, stage, workers

    def send(self, peer: int, msg: Message) -> None:
        self.transport.send(peer % self.workers, replace(msg, cut=min(peer, self.stage)))

    def recv(self, peer: int, mb: int, micro: int | None, what: str, channel: int = 0) -> Message:
        return self.transport.recv(peer % self.workers, mb, micro, f"{what} of stage {self.stage}", channel,
                                   min(peer, self.stage))


class LocalStages:
    """Runs one process's action list over the Workers of the stages it holds.

    Args:
        rank: this process's rank in the looped schedule.
        workers: stage -> its Worker (built with the stage as its rank).
        trace: where each action's (text, start, end) goes, or None.
    """

    def __init__(self, rank: int, workers: dict[int, Worker], trace: list[tuple[str, float, float]] | None) -> None:
        self.rank, self.workers, self.trace = rank, workers, trace

    @property
    def history(self) -> list[StepRecord]:
        """The updates the output stage's Worker recorded (none where this process does not hold it)."""
        return [record for worker in self.workers.values() for record in worker.history]

    @property
    def metrics_log(self) -> MetricsLog | None:
        """The output stage's metrics log, if this process holds that stage and the job keeps one."""
        return next((w.metrics_log for w in self.workers.values() if w.metrics_log is not None), None)

    def run_epoch(self, schedule: Schedule, epoch: int, batches: list[list[int]], mb_offset: int,
                  on_step: Callable[[StepRecord], None] | None = None) -> None:
        """Execute this process's actions of ``schedule`` (looped) for one epoch."""
        view = stage_view(schedule)
        for worker in self.workers.values():
            worker.begin_epoch(view, epoch, batches, mb_offset)
        for action in schedule.actions[self.rank]:
            t0 = time.perf_counter()
            for worker in self._targets(action):
                worker.step(action.local(), on_step)
            if self.trace is not None:
                self.trace.append((str(action), t0, time.perf_counter()))

    def evaluate(self, schedule: Schedule, batches: list[list[int]],
                 metrics: dict[str, Callable[[Any, Any], Any]]) -> list[float]:
        """:meth:`pipetrain.runtime.worker.Worker.evaluate` of a forward-only looped ``schedule``: this
        process's sums (zeros but where it holds the output stage)."""
        view = stage_view(schedule)
        with contextlib.ExitStack() as stack:
            sums = [stack.enter_context(w.evaluating(view, batches, metrics)) for w in self.workers.values()]
            for action in schedule.actions[self.rank]:
                for worker in self._targets(action):
                    worker.step(action.local())
        return [sum(values) for values in zip(*sums)]

    def _targets(self, action: Action) -> list[Worker]:
        """The Workers an action goes to: its stage's, or every one (an update without a stage)."""
        return list(self.workers.values()) if action.stage is None else [self.workers[action.stage]]
