"""The one place that names strategies and pipeline schedules, and turns a name into its object.

A strategy (:mod:`pipetrain.strategies.kinds`) or a schedule (:mod:`pipetrain.schedule.kinds`) is a
small class that owns its options and hooks; a plain name means its defaults (``"gpipe"`` is
``GPipe()``). No other module tests a strategy's or a schedule's name.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from pipetrain.schedule.actions import Schedule
from pipetrain.schedule.kinds import (
    GPipe, Interleaved1F1B, ModelParallel, Naive, OneFOneBFlush, PipeDream, PipelineSchedule, TwoBW, ZeroBubble,
)
from pipetrain.strategies.kinds import CGDP, DDP, Auto, Pipeline, PipeSGD, Strategy

__all__ = ["Auto", "CGDP", "DDP", "DEFAULT_SCHEDULE", "GPipe", "Interleaved1F1B", "ModelParallel", "Naive",
           "OneFOneBFlush", "PipeDream", "PipeSGD", "Pipeline", "PipelineSchedule", "SCHEDULES", "STRATEGIES", "Strategy",
           "TwoBW", "ZeroBubble", "as_schedule", "as_strategy", "build_data_parallel", "build_schedule", "from_options",
           "make", "schedule_of"]


SCHEDULES: dict[str, type[PipelineSchedule]] = {c.name: c for c in (PipeDream, Naive, GPipe, OneFOneBFlush,
                                                                    ModelParallel, ZeroBubble, Interleaved1F1B, TwoBW)}
DEFAULT_SCHEDULE = PipeDream.name


STRATEGIES: dict[str, type[Strategy]] = {c.name: c for c in (Pipeline, DDP, PipeSGD, CGDP)}


# -- names and options ------------------------------------------------------------------------------

def as_schedule(value: str | PipelineSchedule) -> PipelineSchedule:
    """A schedule object from a name (its defaults) or the object itself."""
    if isinstance(value, PipelineSchedule):
        return value
    if not isinstance(value, str) or value not in SCHEDULES:
        raise ValueError(f"unknown schedule {value!r}; choose one of {', '.join(SCHEDULES)}, or an object such as "
                         "pipetrain.GPipe(microbatches=4)")
    return SCHEDULES[value]()


def as_strategy(value: str | Strategy | Auto) -> Strategy | Auto:
    """A strategy object from a name (its defaults) or the object itself."""
    if isinstance(value, (Strategy, Auto)):
        return value
    if value == Auto.name:
        return Auto()
    if not isinstance(value, str) or value not in STRATEGIES:
        raise ValueError(f"unknown strategy {value!r}; choose one of auto, {', '.join(STRATEGIES)}, or an object "
                         "such as pipetrain.PipeSGD(staleness=2)")
    return STRATEGIES[value]()


def make(kind: str, name: str, options: dict[str, Any]) -> Any:
    """The ``kind`` (``"strategy"`` or ``"schedule"``) ``name`` with ``options`` given by name, as the
    CLI's flags give them: an option another strategy or schedule takes is refused in one line
    naming which does take it."""
    table: dict[str, Any] = {**STRATEGIES, Auto.name: Auto} if kind == "strategy" else dict(SCHEDULES)
    cls = as_strategy(name) if kind == "strategy" else as_schedule(name)
    own = {f.name for f in fields(cls)}
    for option in options:
        if option not in own:
            takes = [n for n, c in table.items() if option in {f.name for f in fields(c)}]
            raise ValueError(f"{option} applies to {kind} {' or '.join(map(repr, takes))}, not {name!r}; leave it "
                             f"out or change the {kind}")
    return type(cls)(**options)


def from_options(strategy: str, schedule: str | None = None, **options: Any
                 ) -> tuple[Strategy | Auto, PipelineSchedule | None]:
    """The strategy and schedule objects named, each with the options (given by name, as the CLI's flags
    give them) that it takes; an option that neither takes is refused in one line naming who takes it.
    The schedule is None where neither a schedule nor an option of one is given."""
    chosen = as_strategy(strategy)
    schedule_options = {k: v for k, v in options.items() if any(k in {f.name for f in fields(c)}
                                                                 for c in SCHEDULES.values())}
    strategy_options = {k: v for k, v in options.items() if k not in schedule_options}
    made = make("strategy", strategy, strategy_options)
    if schedule is None and not schedule_options:
        return made, None
    if not isinstance(chosen, Pipeline):
        what = next(iter(schedule_options), "schedule")
        raise ValueError(f"{what} applies to strategy 'pipeline', not {chosen.name!r}; leave it out or change the "
                         "strategy")
    return made, make("schedule", schedule or DEFAULT_SCHEDULE, schedule_options)


def schedule_of(name: str, microbatches: int = 1) -> PipelineSchedule:
    """Schedule ``name`` splitting each minibatch into ``microbatches`` (1: unsplit, which every schedule runs)."""
    return make("schedule", name, {"microbatches": microbatches} if microbatches != 1 else {})


def build_schedule(schedule: str | PipelineSchedule, replicas: Sequence[int], minibatches: int) -> Schedule:
    """The action lists of a pipeline ``schedule`` (a name or an object) over stages of ``replicas``
    workers, for ``minibatches`` minibatches."""
    return as_schedule(schedule).build(replicas, minibatches)


def build_data_parallel(strategy: str | Strategy, workers: int, minibatches: int, epoch: int = 0) -> Schedule:
    """The action lists of a data-parallel ``strategy`` (a name or an object) on ``workers`` workers, for
    ``minibatches`` minibatches of epoch ``epoch`` (Pipe-SGD's warm-up epochs are synchronous)."""
    chosen = as_strategy(strategy)
    if not isinstance(chosen, Strategy) or not chosen.data_parallel:
        raise ValueError(f"strategy {chosen.name!r} is not data parallel; build a pipeline with build_schedule")
    return chosen.build(workers, minibatches, epoch)

