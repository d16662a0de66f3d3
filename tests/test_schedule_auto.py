"""``schedule="auto"``: every schedule priced in the simulator for the plan, the memory each needs, the
pick under a memory limit, and a whole run."""
import functools
import pytest
import torch

import pipetrain
from pipetrain.cli import main
from pipetrain.data import regression
from pipetrain.planning.schedules import choose_schedule
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import GPipe, Interleaved1F1B, OneFOneBFlush
from pipetrain.simulate import Link, simulate
from pt_models import mlp

MB = 1_000_000


def two_layers() -> Profile:
    """Two equal layers of 1 MB weights; the input 1 MB, each layer's output 2 MB, at batch 8."""
    layers = [LayerProfile(str(k), 0.010, 0.020, 2 * MB, MB, 0.001) for k in range(2)]
    return Profile(layers, 8, "cpu", input_bytes=MB)


def rows(choice) -> dict[str, object]:
    return {r.label: r for r in choice.rows}


def test_each_row_is_its_schedule_simulated_and_the_pick_is_the_fastest():
    profile = two_layers()
    choice = choose_schedule(profile, 2, "1Gbit", minibatches=8, schedules=["gpipe", "1f1b-flush", "pipedream"])
    got = rows(choice)
    assert set(got) == {"gpipe", "gpipe m=2", "gpipe m=4", "gpipe m=8", "1f1b-flush", "1f1b-flush m=2",
                        "1f1b-flush m=4", "1f1b-flush m=8", "pipedream"}
    for label, schedule in (("gpipe m=4", GPipe(microbatches=4)), ("1f1b-flush m=2", OneFOneBFlush(microbatches=2))):
        assert got[label].config == "1-1"  # a straight plan of the two layers
        sim = simulate(schedule.build([1, 1], 8), profile, [0, 1], Link(1e9 / 8), 8)
        assert got[label].samples_per_s == pytest.approx(8 * 8 / sim.makespan_s, rel=1e-12), label
    fastest = max(r.samples_per_s for r in choice.rows if not r.why)
    assert choice.chosen.samples_per_s == fastest and choice.chosen.label in choice.reason


def test_memory_counts_weights_versions_and_the_activations_in_flight():
    """The most any worker holds. Stage 0 has 1 MB of weights (and 1 MB of gradient) and keeps 1 + 2 MB per
    minibatch of 8 (its input and its output), stage 1 1 MB (and 1 MB) and 2 + 2 MB. gpipe holds every
    microbatch: stage 1's 1 + 1 + 4 MB; 1f1b-flush with 4 microbatches holds 2 at stage 0 (1 + 1 + 1.5 MB)
    and 1 at stage 1 (1 + 1 + 1 MB); pipedream holds 2 minibatches at stage 0 and 2 stashed weight versions
    besides the live one."""
    choice = choose_schedule(two_layers(), 2, "100Gbit", minibatches=8,
                             schedules=["gpipe", "1f1b-flush", "pipedream"])
    got = rows(choice)
    assert got["gpipe m=4"].memory_bytes == pytest.approx(6 * MB)
    assert got["1f1b-flush m=4"].memory_bytes == pytest.approx(3.5 * MB)
    if got["pipedream"].config == "1-1":
        assert got["pipedream"].memory_bytes == pytest.approx((1 + 2 + 1 + 2 * 3) * MB)


def test_2bw_holds_its_live_weights_and_two_versions():
    choice = choose_schedule(two_layers(), 2, "100Gbit", minibatches=8, schedules=["2bw"])
    row = rows(choice)["2bw m=2"]
    # stage 0 keeps its 1 MB of weights 3 times (live, newest copy, the one before), its 1 MB gradient and
    # both microbatches of 1.5 MB in flight
    assert row.config == "1-1" and row.memory_bytes == pytest.approx(3 * MB + MB + 2 * 1.5 * MB)


def test_a_memory_limit_leaves_out_what_does_not_fit_and_recomputation_can_bring_it_back():
    profile = two_layers()
    # 1f1b-flush m=8 holds 2 of 8 microbatches at stage 0 (1 + 1 + 0.75 MB, weights, gradient, activations);
    # gpipe m=8 all 8 (stage 1: 1 + 1 + 4 MB)
    choice = choose_schedule(profile, 2, "100Gbit", minibatches=8, memory=3 * MB, schedules=["gpipe", "1f1b-flush"])
    got = rows(choice)
    assert got["1f1b-flush m=8"].memory_bytes == pytest.approx(2.75 * MB) and not got["1f1b-flush m=8"].why
    # gpipe m=8 recomputing: stage 1 keeps its 8 inputs (2 MB) and one microbatch's activations (4/8 MB)
    assert got["gpipe m=8 +recompute"].memory_bytes == pytest.approx(MB + MB + 2 * MB + 4 * MB / 8)
    assert "over the limit" in got["gpipe m=8 +recompute"].why
    assert choice.chosen.memory_bytes <= 3 * MB and "memory limit" in choice.reason
    # a limit that gpipe meets only by recomputing
    tight = choose_schedule(profile, 2, "100Gbit", minibatches=8, memory=4.6 * MB, schedules=["gpipe"])
    assert tight.chosen.label == "gpipe m=8 +recompute" and tight.chosen.memory_bytes == pytest.approx(4.5 * MB)
    assert rows(tight)["gpipe m=2 +recompute"].why.startswith("needs 5.72 MiB on a worker, over the limit 4.39 MiB")
    with pytest.raises(ValueError, match=r"^no schedule can run here: 1f1b-flush \+recompute: needs"):
        choose_schedule(profile, 2, "100Gbit", minibatches=8, memory=MB, schedules=["1f1b-flush"])


def test_a_looped_schedule_is_priced_on_two_stages_per_worker():
    """interleaved-1f1b on 2 workers runs 4 stages of one layer each, stage s on worker s mod 2: worker 0
    holds the weights and gradients of stages 0 and 2, and its simulation is the looped schedule's own."""
    layers = [LayerProfile(str(k), 0.010, 0.020, 2 * MB, MB, 0.001) for k in range(4)]
    profile = Profile(layers, 8, "cpu", input_bytes=MB)
    choice = choose_schedule(profile, 2, "100Gbit", minibatches=8, schedules=["interleaved-1f1b"])
    row = rows(choice)["interleaved-1f1b m=2"]
    assert row.config == "1-1-1-1" and not row.why
    sim = simulate(Interleaved1F1B(microbatches=2, workers=2).build([1, 1, 1, 1], 8), profile, [0, 1, 2, 3],
                   Link(100e9 / 8), 8)
    assert row.samples_per_s == pytest.approx(8 * 8 / sim.makespan_s, rel=1e-12)
    assert row.memory_bytes == pytest.approx(2 * MB + 2 * MB + max(sim.peak_activation_bytes))  # weights, gradients


def test_unknown_schedules_and_the_ablation_are_refused_or_never_picked():
    with pytest.raises(ValueError, match="unknown schedules"):
        choose_schedule(two_layers(), 2, "1Gbit", schedules=["zero"])
    choice = choose_schedule(two_layers(), 2, "1Gbit", schedules=["naive", "gpipe"])
    assert rows(choice)["naive"].why.startswith("the ablation") and choice.chosen.schedule == "gpipe"


def test_the_plan_command_prints_the_table_and_the_pick(tmp_path, capsys):
    path = tmp_path / "profile.json"
    two_layers().save(path)
    assert main(["plan", str(path), "--workers", "2", "--schedules", "all", "--bandwidth", "1Gbit",
                 "--memory", "3MB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["schedule", "samples/s", "memory"]
    assert sum("<-" in ln for ln in lines) == 1 and lines[-2].endswith("memory limit 2.86 MiB per worker")
    assert lines[-1].startswith("samples/s: each row a short epoch") and "compute-only bound" in lines[-1]
    assert main(["plan", str(path), "--workers", "2", "--schedules", "all", "--strategies", "all"]) == 1
    assert capsys.readouterr().err.strip() == ("pipetrain plan: error: --strategies and --schedules each pick one "
                                               "thing; give one of them")


def test_schedule_auto_needs_stages_auto():
    with pytest.raises(ValueError, match=r"^schedule='auto' prices every schedule for a plan it makes"):
        pipetrain.train(mlp(), regression(16, 4, 3), loss_fn=torch.nn.functional.mse_loss, batch_size=8,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), schedule="auto", stages=[0, 3])


@pytest.mark.multiprocess
def test_train_with_schedule_auto_prints_the_table_and_runs_the_pick(capsys):
    result = pipetrain.train(mlp(), regression(64, 4, 3), loss_fn=torch.nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.05), schedule="auto", stages="auto",
                             workers=2, bandwidth="1Gbit", batch_size=8, shuffle=False, timeout=60)
    out = capsys.readouterr().out
    table = result.plan.options["schedules"]
    best = table["rows"][table["best"]]
    assert "schedule auto" in out and table["reason"] in out
    assert result.predicted_samples_per_s == best["samples_per_s"]
    assert result.plan.workers == 2 and len(result.history) >= 1
