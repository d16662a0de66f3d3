"""The simulator against pipeline theory: equal stages, free or slow links."""
from __future__ import annotations

import json
import math

import pytest

from pipetrain.cli import main
from pipetrain.planning.result import Plan, StagePlan
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import GPipe, OneFOneBFlush, build_schedule, schedule_of
from pipetrain.schedule import ScheduleError
from pipetrain.schedule.actions import Action, Schedule
from pipetrain.simulate import Link, simulate
from pipetrain.stagecost import stage_costs

F, B = 1e-3, 2e-3  # seconds per layer per minibatch; backward = 2 x forward as in practice


def equal_profile(layers: int, activation_bytes: int = 1000, parameter_bytes: int = 100) -> Profile:
    return Profile([LayerProfile(str(i), F, B, activation_bytes, parameter_bytes) for i in range(layers)],
                   batch_size=1, device="test", input_bytes=500)


def straight(name: str, p: int, minibatches: int, microbatches: int = 1, link: Link = Link()):
    return simulate(build_schedule(schedule_of(name, microbatches), [1] * p, minibatches), equal_profile(p),
                    list(range(p)), link=link)


def test_stage_costs_sum_layers_and_scale_with_batch():
    costs = stage_costs(equal_profile(5), [0, 2], batch_size=3)
    assert [c.forward_s for c in costs] == pytest.approx([6 * F, 9 * F])
    assert costs[0].output_bytes == 3000
    assert costs[1].stash_bytes == 3 * (1000 + 3 * 1000)  # its input plus its three layers' outputs
    assert costs[0].stash_bytes == 3 * (500 + 2 * 1000)
    assert costs[1].parameter_bytes == 300


@pytest.mark.parametrize("p", [2, 4])
def test_pipedream_steady_state_one_minibatch_per_stage_time(p):
    for k in (2 * p, 8 * p):
        assert straight("pipedream", p, k).samples_per_s == pytest.approx(1 / (F + B))
    # over the whole run, startup and drain fade as minibatches grow
    whole = [k / straight("pipedream", p, k).makespan_s * (F + B) for k in (p, 4 * p, 32 * p)]
    assert whole[0] < whole[1] < whole[2] < 1 and whole[2] > 0.9


@pytest.mark.parametrize("p,m", [(4, 1), (4, 4), (4, 8), (3, 5)])
def test_gpipe_bubble_fraction(p, m):
    assert straight("gpipe", p, 1, m).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_model_parallel_busy_one_in_p():
    result = straight("model-parallel", 4, 3)
    assert result.busy_fraction == pytest.approx([0.25] * 4)
    assert result.samples_per_s == pytest.approx(1 / (4 * (F + B)))


def test_weight_versions_input_stage_noam_output_one():
    schedule = build_schedule("pipedream", [1] * 4, 12)
    result = simulate(schedule, equal_profile(4), [0, 1, 2, 3])
    assert result.peak_weight_versions == [schedule.noam, 3, 2, 1] == [4, 3, 2, 1]
    assert straight("1f1b-flush", 4, 3, 4).peak_weight_versions == [1] * 4


def test_activation_stash_follows_in_flight_counts():
    result = straight("pipedream", 4, 12)
    stash = [500 + 1000, 2000, 2000, 2000]  # stage input + its one layer's output
    assert result.peak_activation_bytes == [4 * stash[0], 3 * stash[1], 2 * stash[2], 1 * stash[3]]


def test_transfers_serialize_per_link_direction():
    # stage 0 sends 4 microbatches' activations 0.25 ms apart; each takes 10 ms on the wire, so they queue
    wire = 10e-3
    schedule = build_schedule(GPipe(microbatches=4), [1, 1], 1)
    result = simulate(schedule, equal_profile(2), [0, 1], link=Link(250 / wire))
    sends = [s for text, s, _ in result.trace[0] if text.startswith("SF")]
    arrivals = [e for text, _, e in result.trace[1] if text.startswith("RF")]
    assert sends == pytest.approx([F / 4 * (k + 1) for k in range(4)])
    assert arrivals == pytest.approx([F / 4 + wire * (k + 1) for k in range(4)])


def test_latency_adds_to_every_transfer_and_directions_are_independent():
    result = straight("model-parallel", 2, 1, link=Link(math.inf, 5e-3))
    # F0 | 5 ms to stage 1 | F0 B0 | 5 ms back | B0
    assert result.makespan_s == pytest.approx(2 * (F + B) + 2 * 5e-3)


def test_replicated_stage_syncs_and_round_robins():
    profile = equal_profile(3)
    schedule = build_schedule("pipedream", [2, 1], 8)
    free = simulate(schedule, profile, [0, 2])
    slow = simulate(schedule, profile, [0, 2], link=Link(1e6))
    assert free.peak_weight_versions[:2] == [schedule.noam] * 2
    syncs = [e - s for text, s, e in slow.trace[0] if text.startswith("S") and not text.startswith("SF")]
    # PipeDream §3.2: 4 (m - 1) |w| / m bytes per replica, m = 2, |w| = 200 bytes
    assert min(syncs) == pytest.approx(4 * 200 / 2 / 1e6)
    assert slow.samples_per_s < free.samples_per_s


def test_trace_runs_the_schedule_actions_in_order():
    schedule = build_schedule(OneFOneBFlush(microbatches=2), [1, 1, 1], 2)
    result = simulate(schedule, equal_profile(3), [0, 1, 2], link=Link(1e6, 1e-4))
    for w, records in enumerate(result.trace):
        assert [Action.parse(text) for text, _, _ in records] == list(schedule.actions[w])
        assert all(s <= e for _, s, e in records)
        assert all(e0 <= s1 for (_, _, e0), (_, s1, _) in zip(records, records[1:]))


def test_bad_inputs_fail_clearly():
    with pytest.raises(ValueError, match="2 stage boundaries for a 3-stage"):
        simulate(build_schedule("pipedream", [1] * 3, 3), equal_profile(3), [0, 1])
    stuck = Schedule("custom", (1, 1), ((Action.parse("RB0"), Action.parse("SF0")),
                                        (Action.parse("RF0"), Action.parse("SB0"))))
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(stuck, equal_profile(2), [0, 1])
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(0.0)


def test_unknown_batch_size_gives_minibatches_only():
    profile = equal_profile(2)
    profile.batch_size = 0  # as PipeDream's graph.txt files, which do not say
    schedule = build_schedule("pipedream", [1, 1], 4)
    assert simulate(schedule, profile, [0, 1]).samples_per_s is None
    given = simulate(schedule, profile, [0, 1], batch_size=64)
    assert given.samples_per_s == pytest.approx(64 * given.minibatches_per_s)
    assert given.minibatches_per_s == pytest.approx(1 / (F + B))  # taken as profiled at 64: not scaled


@pytest.mark.parametrize("where", [["--stages", "0,2"], ["--plan", "PLAN"], ["--workers", "2", "--straight"]])
def test_cli_json(tmp_path, capsys, where):
    profile_path, plan_path = tmp_path / "p.json", tmp_path / "plan.json"
    equal_profile(4).save(profile_path)
    Plan([StagePlan(0, 1, 1), StagePlan(2, 3, 1)], 2, 0.0, 1.0, 1.0).save(plan_path)
    where = [str(plan_path) if w == "PLAN" else w for w in where]
    argv = ["simulate", str(profile_path), *where, "--minibatches", "6", "--bandwidth", "1Gbit",
            "--json", "--png", str(tmp_path / "t.png")]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stages"] == [0, 2] and out["replicas"] == [1, 1]
    assert out["peak_weight_versions"] == [2, 1] and len(out["busy_fraction"]) == 2
    assert 0 < out["bubble_fraction"] < 1 and out["samples_per_s"] > 0
    assert (tmp_path / "t.png").stat().st_size > 0


def test_cli_error_is_one_line(tmp_path, capsys):
    equal_profile(4).save(tmp_path / "p.json")
    assert main(["simulate", str(tmp_path / "p.json"), "--stages", "0,2", "--schedule", "nope",
                 "--minibatches", "2"]) == 1
    assert "unknown schedule 'nope'" in capsys.readouterr().err


def test_a_tied_parameter_costs_its_gradient_and_its_value_every_update():
    """Two stages, model-parallel, a parameter of 10 ms on the link read by both: after the output
    stage's update its gradient crosses to the input stage (after the cut's gradient on that link),
    and the new value crosses back before the next activation, so each minibatch adds 2 x 10 ms to
    F + B + a + F + B + a (1 + 2 + 1 + 1 + 2 + 1 ms, activations of 1 ms)."""
    bandwidth = 1e6  # bytes/s: 1000 activation bytes take 1 ms
    plain = equal_profile(2)
    tied = Profile(plain.layers, batch_size=1, device="test", input_bytes=500, ties=[([0, 1], 10_000)])
    assert Profile.from_dict(json.loads(json.dumps(tied.to_dict()))).ties == tied.ties
    schedule = build_schedule(schedule_of("model-parallel", 1), [1, 1], 4)
    for profile, period in ((plain, 8e-3), (tied, 25e-3)):
        sim = simulate(schedule, profile, [0, 1], link=Link(bandwidth, 0.0))
        updates = [end for text, _, end in sim.trace[0] if text.startswith("U")]
        assert [b - a for a, b in zip(updates[1:], updates[2:])] == pytest.approx([period] * 2)
