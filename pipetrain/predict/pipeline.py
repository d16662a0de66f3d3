"""A pipeline plan's throughput under a schedule, from the simulator.

The partitioner's own estimate (PipeDream §3.2) assumes a stage's weight sync overlaps its compute
and leaves out fill and drain; running the schedule's real action lists through the simulator prices
both, which is what ``stages="auto"`` and ``strategy="auto"`` compare plans by.
"""
from __future__ import annotations

import math
from dataclasses import replace

from pipetrain.planning.result import Plan
from pipetrain.profiling import Profile
from pipetrain.schedule.kinds import PipeDream, PipelineSchedule
from pipetrain.simresult import SimResult
from pipetrain.simulate import Link, simulate


def simulate_plan(profile: Profile, chosen: Plan, link: Link, batch_size: int,
                  schedule: PipelineSchedule = PipeDream(), minibatches: int = 32) -> tuple[SimResult, int]:
    """``chosen`` run by ``schedule`` over ``link`` in the simulator for about ``minibatches``, rounded up
    so every replica joins every sync: the result and the minibatches simulated."""
    every = math.lcm(*chosen.replicas)
    count = -(-minibatches // every) * every
    return simulate(schedule.build(chosen.replicas, count), profile, chosen.boundaries, link, batch_size), count


def epoch_rate(sim: SimResult, minibatches: int, batch_size: int) -> float:
    """Samples/s of an epoch of ``minibatches`` as it runs: the pipeline filled at its start and drained at
    its end (samples over the simulated makespan; the runtime runs each epoch so)."""
    return minibatches * batch_size / sim.makespan_s if sim.makespan_s > 0 else 0.0


def predict_plan(profile: Profile, chosen: Plan, link: Link, batch_size: int,
                 schedule: PipelineSchedule = PipeDream(), minibatches: int = 32, epoch: bool = False) -> float:
    """Samples/s of ``chosen`` run by ``schedule`` over ``link`` (:func:`simulate_plan`): the steady rate,
    or with ``epoch`` the rate of an epoch as it runs (:func:`epoch_rate`)."""
    sim, count = simulate_plan(profile, chosen, link, batch_size, schedule, minibatches)
    return epoch_rate(sim, count, batch_size) if epoch else sim.samples_per_s or 0.0


def price_plan(profile: Profile, chosen: Plan, link: Link, batch_size: int | None = None,
               minibatches: int = 32) -> Plan:
    """``chosen`` with its steady samples/s under ``pipedream`` at ``batch_size`` (default: the profile's; 0
    where neither is known), as ``pipetrain simulate --plan`` prints it, so that ``plan``, ``plan
    --strategies``, ``simulate`` and ``train --plan`` show one figure for one plan.

    Without a run set-up in ``profile`` nothing prices a message's latency and CPU, workers sharing cores
    or a sync's per-step latency, which on one machine cost far more than the compute of a small model:
    the figure is then marked a bound (:attr:`Plan.bound`), never compared as a prediction."""
    batch = batch_size or profile.batch_size
    rate = predict_plan(profile, chosen, link, batch, minibatches=minibatches) if batch > 0 else 0.0
    return replace(chosen, samples_per_s=rate, bound=profile.setup is None,
                   options={**chosen.options, "batch_size": batch})
