"""Replicated stages and deep pipelines, timed by hand: what the simulator runs (pipetrain's ``pipedream``
schedule: a replicated stage syncs every round before a replica's next forward) against PipeDream §3.2's
closed form, which hides the sync behind compute and lets replicas run unsynchronized; and steady-state
windows whose length is no multiple of the stages' replicas."""
from __future__ import annotations

import math

import pytest

from pathlib import Path

from pipetrain.cli.planning import describe
from pipetrain.costs import boundary_time, stage_time
from pipetrain.planning import parse_bandwidth, plan
from pipetrain.planning.result import Plan, StagePlan
from pipetrain.predict.pipeline import (
    best_plan, halvings, simulate_plan, simulate_steady, steady_rate, window_minibatches,
)
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.schedule.kinds import PipeDream
from pipetrain.simulate import Link, simulate


def layers(*f_b: tuple[float, float], nbytes: int = 0) -> Profile:
    """One layer per stage with forward and backward seconds ``f_b``, ``nbytes`` of activations each."""
    return Profile([LayerProfile(str(k), f, b, nbytes, 400) for k, (f, b) in enumerate(f_b)],
                   batch_size=1, device="test")


def updates(sim, worker: int) -> list[float]:
    return [end for text, _, end in sim.trace[worker] if text.startswith("U")]


def test_three_replicas_pay_their_sync_after_compute():
    """3-1: stage 0 F 1 s, B 2 s on 3 replicas, a 3 s sync; stage 1 F = B = 0.5 s; free links, free steps.

    By hand: replica 0 runs F0 [0,1], F3 [1,2] (warm-up ceil(4/3) = 2), B0 [2,4]; replicas 1 and 2 get
    their gradients at 3 and 4 (stage 1 takes one minibatch per second), end B1 at 5 and B2 at 6; the sync
    runs [6,9], every replica updates at 9. From then each round is F (1) + B (2) + sync (3) = 6 s for 3
    minibatches, the gradients of round k+1 having arrived meanwhile: 0.5 minibatches/s, (c + s) / r per
    minibatch (``stage_time(..., overlap=False)``). The paper's T = max(c, s) / r = 1 s predicts 1/s."""
    profile = layers((1.0, 2.0), (0.5, 0.5))
    sched = PipeDream().build([3, 1], 30)
    sim = simulate(sched, profile, [0, 1], Link(), update_s=0.0, sync_s=[3.0, 0.0])
    assert [(t, s, e) for t, s, e in sim.trace[0] if t[0] in "FB"][:4] == [
        ("F0", 0.0, 1.0), ("F3", 1.0, 2.0), ("B0", 2.0, 4.0), ("F6", 9.0, 10.0)]
    assert updates(sim, 0)[:3] == [9.0, 15.0, 21.0]
    assert steady_rate(sched, sim) == pytest.approx(0.5, rel=1e-12)
    assert 1 / stage_time(3.0, 3.0, 3) == pytest.approx(1.0)
    assert 1 / stage_time(3.0, 3.0, 3, overlap=False) == pytest.approx(0.5)  # the sync added, as simulated


def test_two_replicas_wait_for_the_stage_behind_them():
    """2-1-1: stage 0 F = B = 1 s on 2 replicas, a 2 s sync; stages 1 and 2 F = B = 0.5 s; free links.

    By hand: round 0's sync runs [5,7] (replica 1's B1 ends at 5). Then stage 1's 1F1B order puts F4
    before B3, and F4 comes from replica 0 only after the sync (F4 [7,8]): B3 reaches replica 1 at 9,
    its B3 runs [9,10], the sync [10,12]. Each round after takes 5 s for 2 minibatches (0.4/s): more than
    (c + s) / r = 2 s per minibatch (0.5/s), and the paper's max(c, s) / r = 1 s (1/s) is further still."""
    profile = layers((1.0, 1.0), (0.5, 0.5), (0.5, 0.5))
    sched = PipeDream().build([2, 1, 1], 40)
    sim = simulate(sched, profile, [0, 1, 2], Link(), update_s=0.0, sync_s=[2.0, 0.0, 0.0])
    assert updates(sim, 0)[:4] == [7.0, 12.0, 17.0, 22.0]
    assert steady_rate(sched, sim) == pytest.approx(0.4, rel=1e-12)


def test_a_deep_pipeline_waits_for_its_round_trip():
    """Three stages of F = B = 1 s, each cut 1 s on the link each way. The paper's period is
    max(T, 2 C) = 2 s (0.5/s). But stage 0 holds 3 minibatches in flight (NOAM) and each needs a round
    trip F0 + C + F1 + C + F2 + B2 + C + B1 + C + B0 = 10 s before its slot frees: 3 per 10 s, 0.3/s
    (stage 1: 2 in flight per 6 s, 1/3 s; the slower bound holds)."""
    profile = layers((1.0, 1.0), (1.0, 1.0), (1.0, 1.0), nbytes=1000)
    sched = PipeDream().build([1, 1, 1], 60)
    sim = simulate(sched, profile, [0, 1, 2], Link(1000.0), update_s=0.0)
    assert steady_rate(sched, sim) == pytest.approx(0.3, rel=1e-9)
    assert boundary_time(1000.0, 1000.0) == 2.0


@pytest.mark.parametrize("replicas", [[3, 1], [2, 1, 1], [5, 3, 2], [7, 4]])
def test_a_window_of_any_length_gives_the_steady_rate_of_whole_rounds(replicas):
    """A window whose length no stage's replicas divide (its partial rounds update unsynced) measures the
    rate a run of whole rounds (a multiple of every count, far longer) has in its middle."""
    n = len(replicas)
    profile = layers(*[(0.2 * (k + 1), 0.4 * (k + 1)) for k in range(n)], nbytes=100)
    bounds = list(range(n))
    syncs = [0.3 * r if r > 1 else 0.0 for r in replicas]
    window = window_minibatches(replicas)
    window += all(window % r == 0 for r in replicas)
    assert any(window % r for r in replicas)
    short = PipeDream().window(replicas, window)
    every = math.lcm(*replicas)
    whole = PipeDream().build(replicas, every * -(-240 // every))
    rates = [steady_rate(s, simulate(s, profile, bounds, Link(1000.0), update_s=0.0, sync_s=syncs))
             for s in (short, whole)]
    assert rates[0] == pytest.approx(rates[1], rel=0.02)


def test_stages_whose_counts_beat_are_measured_over_whole_common_periods():
    """Replicas 9, 8 and 10 between two single stages repeat their pattern every 360 minibatches, with
    fast and slow stretches: ten rounds of 10 and six per stage (130 minibatches) read 0.534/s, 8% fast.
    The window spans two common periods beside its end margin, and reads what a window four times as long
    reads."""
    replicas = [1, 9, 8, 10, 1]
    profile = layers((0.1, 0.2), (0.9, 1.8), (0.8, 1.6), (1.0, 2.0), (0.1, 0.2), nbytes=100)
    syncs = [0.3 * r if r > 1 else 0.0 for r in replicas]
    window = window_minibatches(replicas)
    assert window >= 2 * 360

    def rate(n: int) -> float:
        s = PipeDream().window(replicas, n)
        return steady_rate(s, simulate(s, profile, list(range(5)), Link(1000.0), update_s=0.0, sync_s=syncs))
    assert rate(window) == pytest.approx(rate(4 * window), rel=1e-6)
    assert rate(130) > 1.07 * rate(window)


def test_a_plan_simulates_in_a_window_whatever_its_counts():
    """Replicas 37, 55 and 26 need 52910 minibatches for whole rounds; the window takes four times the
    4 x 37 minibatches the input stage keeps in flight (more than 10 rounds of 55 and 6 per stage)."""
    profile = layers((1.0, 2.0), (1.5, 3.0), (1.0, 2.0), nbytes=100)
    chosen = Plan([StagePlan(0, 0, 37), StagePlan(1, 1, 55), StagePlan(2, 2, 26)], 3, 0.1, 1.0, 1.0)
    assert window_minibatches(chosen.replicas) == 592
    sim = simulate_steady(profile, chosen, Link(1e5))
    assert sim.minibatches_per_s > 0
    epoch, count = simulate_plan(profile, chosen, Link(1e5), 1, minibatches=16)  # as schedule="auto" prices
    assert count == 592 and epoch.minibatches_per_s > 0


def test_a_plan_for_more_workers_that_runs_slower_gives_way_to_fewer():
    """vgg16 at 10 Gbit/s: the partitioner's 64-worker plan ties on the transfer into the one FC worker with
    its plan for 34, and replicates a 2 ms stage 27 times, whose every-round sync the simulator prices; the
    plan taken is the fastest simulated of the partitioner's plans for 64, its tie and the halvings, and
    says that it uses fewer workers."""
    profile = Profile.load(Path(__file__).resolve().parents[1] / "pipetrain" / "data" / "pipedream" / "vgg16.graph.txt")
    link = Link(parse_bandwidth("10Gbit"))
    found = plan(profile, 64, "10Gbit", also=halvings(64))
    assert halvings(64) == [32, 16, 8, 4, 2, 1]
    assert {p.workers for p in found.alternatives} >= {34, 32, 16}
    chosen = best_plan(profile, found, link)
    rates = {p.config: simulate_steady(profile, p, link).minibatches_per_s for p in [found, *found.alternatives]}
    assert rates[chosen.config] == max(rates.values()) > rates[found.config]
    assert chosen.workers < 64 and f"uses {chosen.workers} of the 64 workers" in describe(chosen, profile)


def test_schedule_auto_runs_the_plan_that_plan_prints():
    """vgg16 on 64 workers at 10 Gbit/s: the replicating schedules run 42-1, the plan ``pipetrain plan``
    prints, not the partitioner's 33-1-1-1-1-27; where every worker must take part, a plan for all 64."""
    from dataclasses import replace

    from pipetrain.planning.schedules import choose_schedule

    profile = replace(Profile.load(Path(__file__).resolve().parents[1] / "pipetrain" / "data" / "pipedream" /
                                   "vgg16.graph.txt"), batch_size=64)
    assert plan(profile, 64, "10Gbit").config == "33-1-1-1-1-27"
    assert choose_schedule(profile, 64, "10Gbit", schedules=["pipedream"]).plan.config == "42-1"
    every = choose_schedule(profile, 64, "10Gbit", schedules=["pipedream"], fewer_workers=False).plan
    assert every.workers == 64
