"""A pipeline plan's throughput under a schedule, from the simulator.

The partitioner's own estimate (PipeDream §3.2) assumes a stage's weight sync overlaps its compute
and leaves out fill and drain; running the schedule's real action lists through the simulator prices
both, which is what ``stages="auto"`` and ``strategy="auto"`` compare plans by.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipetrain.planning.partition import plan
from pipetrain.planning.result import Plan
from pipetrain.profiling import Profile
from pipetrain.schedule import Schedule
from pipetrain.schedule.actions import UPDATE
from pipetrain.schedule.generators import noam
from pipetrain.schedule.kinds import PipeDream, PipelineSchedule
from pipetrain.simresult import SimResult
from pipetrain.simulate import Link, simulate


def simulate_plan(profile: Profile, chosen: Plan, link: Link, batch_size: int,
                  schedule: PipelineSchedule = PipeDream(), minibatches: int = 32) -> tuple[SimResult, int]:
    """``chosen`` run by ``schedule`` over ``link`` in the simulator for about ``minibatches``, rounded up
    so every replica joins every sync: the result and the minibatches simulated. Where whole rounds of
    every stage would take more than :data:`WHOLE_PERIOD_MAX` minibatches (37, 55 and 26 replicas: 52910),
    a window as long as :func:`window_minibatches` says, whose partial last rounds update unsynced."""
    every = math.lcm(*chosen.replicas)
    if every <= WHOLE_PERIOD_MAX:
        count = -(-minibatches // every) * every
        built = schedule.build(chosen.replicas, count)
    else:
        count = window_minibatches(chosen.replicas, minibatches)
        built = schedule.window(chosen.replicas, count)
    return simulate(built, profile, chosen.boundaries, link, batch_size), count


WHOLE_PERIOD_MAX = 512
"""The longest pattern of rounds (the least common multiple of a plan's replica counts) whose whole
periods a steady-state window spans: stages of co-prime counts (8, 9 and 10 replicas) beat against each
other, fast and slow stretches alternating over their common period."""


def window_minibatches(replicas: Sequence[int], minibatches: int = 32) -> int:
    """Minibatches a steady-state window of a plan simulates: at least ``minibatches``, ten rounds of its
    most replicated stage beside six per stage, four times the minibatches the input stage keeps in flight
    (NOAM per replica, PipeDream §3.3), and, where the replica counts' common period is at most
    :data:`WHOLE_PERIOD_MAX`, two such periods beside :func:`steady_rate`'s margin: the first half fills
    the pipeline and lets its rounds and queues settle (a deep plan of mixed counts runs fast until its
    queues fill, over about twice its minibatches in flight), :func:`steady_rate` measures whole periods
    of the second, or at least four rounds (see docs/simulator.md, steady state)."""
    cycle = noam(replicas)
    count = max(minibatches, 10 * max(replicas) + 6 * len(replicas), 4 * cycle * replicas[0])
    period = math.lcm(*replicas)
    if period <= WHOLE_PERIOD_MAX:
        count = max(count, 2 * (period + _end_margin(replicas, cycle)) + 2)
    return count


def _end_margin(replicas: Sequence[int], noam_count: int) -> int:
    """Minibatches :func:`steady_rate` leaves out before a window's end: its drain begins once the input
    stage admits no more (its minibatches in flight before the end), and a round of the most replicated
    stage and two per stage."""
    return max(max(replicas) + 2 * len(replicas), noam_count * replicas[0])


def steady_rate(schedule: Schedule, sim: SimResult) -> float:
    """Minibatches/s of ``sim`` (a run of ``schedule``, e.g. its :meth:`~PipelineSchedule.window`) in its
    steady state: over whole rounds of the output stage from the middle of its minibatches to the margin
    before the end that :func:`_end_margin` gives, as many minibatches as whole periods of every stage's
    rounds (with NOAM, the input stage's cycle, or without), else whole rounds of the most replicated stage
    (with NOAM or without), take where they fit, since the output stage's steps come in their bursts and
    stages of different counts beat; each round ended by the last of its replicas' steps. The fill before and the drain and unsynced partial rounds
    after are left out, so the window's count need not be a multiple of any stage's replicas."""
    last = schedule.num_stages - 1
    r = schedule.replicas[last]
    first = schedule.first_worker(last)
    done: dict[int, float] = {}  # minibatch -> the end of the output stage's step that applied it
    for w in range(first, first + r):
        for (_, _, end), a in zip(sim.trace[w], schedule.actions[w]):
            if a.kind == UPDATE:
                done[a.mb] = end
    count, most = len(done), max(schedule.replicas)
    k1, k2 = -(-count // (2 * r)), (count - _end_margin(schedule.replicas, schedule.noam)) // r
    every = math.lcm(*schedule.replicas)
    for period in (math.lcm(every, schedule.noam), every, math.lcm(most, schedule.noam), most):  # where they fit
        if (k2 - k1) * r >= period:
            k2 -= (k2 - k1) * r % period // r
            break
    if k2 <= k1:
        return sim.minibatches_per_s
    ends = [max(done[mb] for mb in range(k * r - r, k * r)) for k in (k1, k2)]
    return (k2 - k1) * r / (ends[1] - ends[0]) if ends[1] > ends[0] else sim.minibatches_per_s


def simulate_steady(profile: Profile, chosen: Plan, link: Link, batch_size: int | None = None,
                    schedule: PipelineSchedule = PipeDream(), minibatches: int = 32) -> SimResult:
    """``chosen`` run by ``schedule`` over ``link`` for a window of :func:`window_minibatches`, its rates
    those of the steady state (:func:`steady_rate`): seconds to simulate whatever its replica counts."""
    built = schedule.window(chosen.replicas, window_minibatches(chosen.replicas, minibatches))
    sim = simulate(built, profile, chosen.boundaries, link, batch_size)
    rate = steady_rate(built, sim)
    batch = profile.batch_size if batch_size is None else batch_size
    return replace(sim, minibatches_per_s=rate, samples_per_s=rate * batch if batch > 0 else None)


def epoch_rate(sim: SimResult, minibatches: int, batch_size: int) -> float:
    """Samples/s of an epoch of ``minibatches`` as it runs: the pipeline filled at its start and drained at
    its end (samples over the simulated makespan; the runtime runs each epoch so)."""
    return minibatches * batch_size / sim.makespan_s if sim.makespan_s > 0 else 0.0


def predict_plan(profile: Profile, chosen: Plan, link: Link, batch_size: int,
                 schedule: PipelineSchedule = PipeDream(), minibatches: int = 32, epoch: bool = False) -> float:
    """Samples/s of ``chosen`` run by ``schedule`` over ``link`` (:func:`simulate_plan`): the steady rate,
    or with ``epoch`` the rate of an epoch as it runs (:func:`epoch_rate`)."""
    if not epoch:
        return simulate_steady(profile, chosen, link, batch_size, schedule, minibatches).samples_per_s or 0.0
    sim, count = simulate_plan(profile, chosen, link, batch_size, schedule, minibatches)
    return epoch_rate(sim, count, batch_size)


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


def propose(profile: Profile, workers: int, bandwidth: float | str, **options: Any) -> Plan:
    """The partitioner's plan for ``workers`` (PipeDream §3.2, ``plan(profile, workers, bandwidth,
    **options)``), with :attr:`~Plan.alternatives` for :func:`best_plan` to weigh: its plans for each
    halving of the workers and their ties, and the same from the model whose replicated stages add their
    sync to their compute, as pipetrain's schedule runs them (``sync_overlaps=False``): two solves."""
    found = plan(profile, workers, bandwidth, also=halvings(workers), **options)
    added = plan(profile, workers, bandwidth, also=halvings(workers), sync_overlaps=False, **options)
    found.alternatives += [added, *added.alternatives]
    return found


BOUND_SLACK = 1.05
"""How far a plan's simulated rate may exceed :func:`_bound` before skipping it could lose the best."""


def _bound(chosen: Plan) -> float:
    """Minibatches/s no run of ``chosen`` beats: each replica of a stage computes, then waits at least
    its sync (or, as §3.2 prices it, the larger of the two), r of them per round; boundaries left out,
    since the simulator's links are duplex where the partitioner charges 2 C."""
    slowest = max(s.time_s for s in chosen.stages)
    return 1 / slowest if slowest > 0 else math.inf


def halvings(workers: int) -> list[int]:
    """``workers`` halved down to one: the counts whose plans :func:`best_plan` weighs against a plan."""
    return [workers >> k for k in range(1, workers.bit_length())]


def best_plan(profile: Profile, chosen: Plan, link: Link, batch_size: int | None = None,
              minibatches: int = 32, schedule: PipelineSchedule = PipeDream(), every_worker: bool = False) -> Plan:
    """The fastest in the simulator's steady state under ``schedule`` of ``chosen`` and its
    :attr:`~Plan.alternatives` (plans for fewer workers), priced as :func:`price_plan` prices it; of
    equally fast ones the fewest workers.

    Why: the partitioner's model (PipeDream §3.2) hides a replicated stage's sync behind its compute and
    lets its replicas run unsynchronized, while pipetrain's ``pipedream`` schedule syncs every round
    before a replica's next forward, so a plan with more replicas can run slower than one for fewer
    workers, and plans the model finds equally fast need not be (docs/planning.md, scaling). Every
    candidate's simulated minibatches/s (0 for one skipped as no faster than its bound) is kept in
    ``options["simulated"]`` and the workers asked for in ``options["asked_workers"]``, so a plan that uses
    fewer can say so.

    With ``every_worker`` only the plans for all of ``chosen``'s workers are taken, as a job started on
    them runs; where a plan for fewer simulates faster, ``options["fewer_workers_faster"]`` names it
    (``workers``, ``config``, ``samples_per_s``) so that the job can say so."""
    unique: dict[tuple[int, str, tuple[int, ...]], Plan] = {}
    for p in [chosen, *chosen.alternatives]:  # of two models' same plan, the first's (the paper's) figures
        unique.setdefault((p.workers, p.config, tuple(p.boundaries)), p)
    plans = list(unique.values())
    plans.sort(key=lambda p: (-_bound(p), p.workers))
    mine = [not every_worker or p.workers == chosen.workers for p in plans]  # the plans that may be taken
    rates: list[float] = []
    for k, p in enumerate(plans):  # a plan whose bound is below the best rate it could beat cannot win: rate 0
        top = max((r for i, r in enumerate(rates) if mine[i] or not mine[k]), default=0.0)
        rates.append(simulate_steady(profile, p, link, batch_size, schedule, minibatches).minibatches_per_s
                     if _bound(p) * BOUND_SLACK >= top * (1 - 1e-9) else 0.0)

    def fastest(among: list[int]) -> int:
        """Of the plans ``among``, the fastest; of equally fast ones the fewest workers."""
        top = max(rates[i] for i in among)
        return min((i for i in among if rates[i] >= top * (1 - 1e-9)), key=lambda i: plans[i].workers)
    best = fastest([i for i in range(len(plans)) if mine[i]])
    batch = batch_size or profile.batch_size
    options = {**plans[best].options, "batch_size": batch, "asked_workers": chosen.workers,
               "simulated": {f"{p.workers}:{p.config}": r for p, r in zip(plans, rates)}}
    overall = fastest(list(range(len(plans))))
    if plans[overall].workers < plans[best].workers:  # only where every_worker keeps the faster one out
        options["fewer_workers_faster"] = {"workers": plans[overall].workers, "config": plans[overall].config,
                                           "samples_per_s": rates[overall] * batch if batch > 0 else 0.0}
    return replace(plans[best], samples_per_s=rates[best] * batch if batch > 0 else 0.0,
                   bound=profile.setup is None, options=options)
