"""The partitioner and a plan's prediction, with what a profile and a measured run set-up add: the
optimizer step, message latency, straggling replicas, microbatches, filling and draining."""
from __future__ import annotations

import dataclasses

import pytest

from handmade import MS, setup

from pipetrain.planning import Plan, StagePlan, plan
from pipetrain.predict.pipeline import predict_plan
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import GPipe
from pipetrain.simulate import Link


def test_a_gpipe_plan_is_predicted_at_its_microbatches():
    """Two stages of 1 ms forward and 2 ms backward per minibatch, free links, no optimizer time: GPipe
    with m microbatches takes (m + S - 1)(f + b)/m per minibatch, 5 x 0.75 = 3.75 ms at m = 4 (6 ms at
    m = 1: one minibatch at a time)."""
    layers = [LayerProfile(str(i), 0.5 * MS, 1 * MS, 0, 0) for i in range(4)]
    profile = Profile(layers, batch_size=8, device="test")
    straight = Plan([StagePlan(0, 1, 1), StagePlan(2, 3, 1)], noam=1, stage_time_s=3 * MS, speedup_vs_one=2,
                    speedup_vs_dp=1)
    assert predict_plan(profile, straight, Link(), 8, GPipe(microbatches=4)) == pytest.approx(8 / (3.75 * MS))
    assert predict_plan(profile, straight, Link(), 8, GPipe()) == pytest.approx(8 / (6 * MS))


def test_an_epochs_prediction_counts_filling_and_draining_the_pipeline():
    """pipedream, two stages of 1 ms forward and 2 ms backward, free links, no optimizer time: steady, a
    minibatch every 3 ms. An epoch of one minibatch takes 1 + 1 + 2 + 2 = 6 ms; of two, stage 0 runs F0
    F1 at 0-2, stage 1 F0 B0 F1 B1 at 1-2, 2-4, 4-5, 5-7, stage 0 B0 B1 at 4-6, 7-9: 9 ms."""
    layers = [LayerProfile(str(i), 0.5 * MS, 1 * MS, 0, 0) for i in range(4)]
    profile = Profile(layers, batch_size=8, device="test")
    straight = Plan([StagePlan(0, 1, 1), StagePlan(2, 3, 1)], noam=2, stage_time_s=3 * MS, speedup_vs_one=2,
                    speedup_vs_dp=1)
    assert predict_plan(profile, straight, Link(), 8) == pytest.approx(8 / (3 * MS))
    assert predict_plan(profile, straight, Link(), 8, minibatches=1, epoch=True) == pytest.approx(8 / (6 * MS))
    assert predict_plan(profile, straight, Link(), 8, minibatches=2, epoch=True) == pytest.approx(16 / (9 * MS))


def test_the_planner_counts_the_optimizer_step():
    """Four layers of equal compute; layer 0's optimizer step is as long as two layers' compute, so the
    balanced split moves from [0, 2] to [0, 1]."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100, optimizer_s=6 * MS if i == 0 else 0.0) for i in range(4)]
    profile = Profile(layers, batch_size=8, device="test", input_bytes=10)
    assert plan(profile, 2, "100Gbit", straight=True).boundaries == [0, 1]
    without = Profile([LayerProfile(x.name, x.forward_s, x.backward_s, 10, 100) for x in layers], 8, "test")
    assert plan(without, 2, "100Gbit", straight=True).boundaries == [0, 2]


def test_the_planner_charges_message_latency_to_every_boundary():
    """Two layers whose split halves the compute: worth it on a free link, not with 10 ms per message."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100) for i in range(2)]
    fast = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=setup(latency_s=0.0, slowdown=1.0))
    slow = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=setup(latency_s=10 * MS, slowdown=1.0))
    assert len(plan(fast, 2, "100Gbit", straight=True, fewer_workers=True).stages) == 2
    assert len(plan(slow, 2, "100Gbit", straight=True, fewer_workers=True).stages) == 1


def test_the_output_stage_pays_no_message_latency():
    """Nothing leaves the output stage. With 10 ms per message, one stage of two layers (1 + 2 ms each)
    on one worker takes its 6 ms per minibatch, not the 20 ms of a boundary behind it; split in two, the
    one boundary between the stages pays 2 x (10 ms + 10 B x 1 us/B)."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100) for i in range(2)]
    slow = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=setup(latency_s=10 * MS, slowdown=1.0))
    assert plan(slow, 1, "100Gbit").stage_time_s == pytest.approx(6 * MS)
    assert plan(slow, 2, "100Gbit", straight=True).stage_time_s == pytest.approx(2 * (10 * MS + 10e-6))


def test_one_stage_on_every_worker_is_priced_as_the_partitioner_prices_a_stage():
    """Two layers (3 ms of forward and backward each, 100 bytes of weights) on 4 workers as one stage,
    no set-up: PipeDream's T = max(6 ms, parameter-server sync of 4 x 3/4 x 200 B at 100 Gbit/s) / 4."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100) for i in range(2)]
    one = plan(Profile(layers, batch_size=8, device="test", input_bytes=10), 4, "100Gbit", one_stage=True)
    assert (one.replicas, one.boundaries, one.noam) == ([4], [0], 1)
    assert one.stage_time_s == pytest.approx(6 * MS / 4)
    assert one.speedup_vs_dp == pytest.approx(1.0)


def test_the_planner_stops_replicating_when_replicas_straggle():
    """Layers of 3 ms and 6 ms (forward + backward): replicated on 2 workers a minibatch takes 9/2 ms,
    as a pipeline the slower stage's 6 ms. With a jitter of 4 ms per second, the replicas' 9 ms vary by
    σ = 6 ms and the later one comes 0.5642σ = 3.4 ms late: (9 + 3.4)/2 = 6.2 ms, and the pipeline wins."""
    layers = [LayerProfile("0", 1 * MS, 2 * MS, 10, 100), LayerProfile("1", 2 * MS, 4 * MS, 10, 100)]
    steady = setup(cores=8, slowdown=1.0, latency_s=0.0)
    for jitter, replicas in ((0.0, [2]), (4 * MS, [1, 1])):
        profile = Profile(layers, batch_size=8, device="test", input_bytes=10,
                          setup=dataclasses.replace(steady, jitter_s=jitter))
        assert plan(profile, 2, "100Gbit").replicas == replicas
