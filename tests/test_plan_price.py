"""One figure for one plan: ``plan``, ``plan --strategies``, ``simulate --plan`` and ``train --plan`` price
it the same way, and a plan priced without a run set-up is a bound, never a prediction."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from handmade import MS, setup

from pipetrain import cli
from pipetrain.api import _priced
from pipetrain.planning import Plan
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import GPipe, PipeDream

VGG16 = Path(__file__).resolve().parents[1] / "pipetrain" / "data" / "pipedream" / "vgg16.graph.txt"


def json_out(capsys, *argv: str) -> dict:
    assert cli.main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def four_layers(tmp_path: Path, measured: bool) -> Path:
    """Four unequal layers at batch 8, with or without the hand-made run set-up of two workers."""
    layers = [LayerProfile(str(i), f * MS, 2 * f * MS, 4000, 800, optimizer_s=0.1 * MS)
              for i, f in enumerate((1.0, 3.0, 2.0, 1.5))]
    path = tmp_path / "profile.json"
    Profile(layers, batch_size=8, device="test", input_bytes=400, setup=setup() if measured else None).save(path)
    return path


@pytest.mark.parametrize("source, workers, bandwidth, batch", [
    ("vgg16", 4, "1Gbit", ["--batch-size", "64"]),  # a pipeline of several stages, PipeDream's profile
    ("vgg16", 2, "100Gbit", ["--batch-size", "64"]),  # one stage on every worker
    ("vgg16", 64, "10Gbit", ["--batch-size", "64"]),  # replicated stages, no window a multiple of them all
    ("measured", 2, "10Gbit", []),  # the run set-up prices messages, syncs and shared cores
    ("unmeasured", 2, "10Gbit", []),
])
def test_plan_strategies_and_simulate_give_one_figure_for_one_plan(capsys, tmp_path, source, workers, bandwidth,
                                                                     batch):
    profile = VGG16 if source == "vgg16" else four_layers(tmp_path, source == "measured")
    saved = tmp_path / "plan.json"
    planned = json_out(capsys, "plan", profile, "--workers", workers, "--bandwidth", bandwidth, *batch, "--json",
                       "-o", saved)
    rate = planned["samples_per_s"]
    assert rate > 0 and Plan.load(saved).samples_per_s == rate
    assert planned["bound"] == (source != "measured")
    simulated = json_out(capsys, "simulate", profile, "--plan", saved, "--bandwidth", bandwidth, *batch, "--json")
    assert simulated["samples_per_s"] == pytest.approx(rate, rel=1e-12)
    choice = json_out(capsys, "plan", profile, "--workers", workers, "--bandwidth", bandwidth, *batch,
                      "--strategies", "pipeline", "--json") if len(planned["stages"]) > 1 else None
    if choice is not None:
        assert choice["predictions"]["pipeline"] == pytest.approx(rate, rel=1e-12)
    else:  # data parallelism competes as ddp; the pipeline's row still shows the plan's figure
        assert cli.main([str(a) for a in ("plan", profile, "--workers", workers, "--bandwidth", bandwidth, *batch,
                                          "--strategies", "pipeline,ddp")]) == 0
        assert f"one stage on every worker ({rate:.0f} samples/s as `train --plan` runs it)" in capsys.readouterr().out


def test_a_plan_without_a_run_set_up_prints_a_bound_not_a_prediction(capsys, tmp_path):
    for name in ("bare", "measured"):
        (tmp_path / name).mkdir()
    bare, measured = four_layers(tmp_path / "bare", False), four_layers(tmp_path / "measured", True)
    assert cli.main(["plan", str(bare), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "compute-only bound: " in out and "not a prediction" in out and "--setup 2" in out
    assert "predicted" not in out.replace("not a prediction", "")
    assert cli.main(["simulate", str(bare), "--workers", "2"]) == 0
    assert "compute-only bound, not a prediction" in capsys.readouterr().out
    assert cli.main(["plan", str(measured), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "predicted: " in out and "compute-only" not in out
    assert cli.main(["simulate", str(measured), "--workers", "2"]) == 0
    assert "predicted with the profile's run set-up" in capsys.readouterr().out


def test_train_takes_a_plans_figure_as_its_prediction_only_where_it_predicts_this_run():
    priced = Plan.from_dict({**_plan_dict(), "samples_per_s": 1000.0, "bound": False})
    assert _priced(priced, 8, PipeDream()) == 1000.0
    assert _priced(priced, 16, PipeDream()) is None  # priced at another batch size
    assert _priced(priced, 8, GPipe(microbatches=2)) is None  # priced under pipedream
    bound = Plan.from_dict({**_plan_dict(), "samples_per_s": 1000.0, "bound": True})
    assert _priced(bound, 8, PipeDream()) is None
    assert _priced(Plan.from_dict(_plan_dict()), 8, PipeDream()) is None  # a plan saved before plans were priced


def _plan_dict() -> dict:
    return {"format": "pipetrain-plan", "version": 1, "config": "1-1", "noam": 2, "stage_time_s": 0.01,
            "speedup_vs_one": 1.5, "speedup_vs_dp": 1.0, "options": {"batch_size": 8},
            "stages": [{"first_layer": 0, "last_layer": 1, "replicas": 1},
                       {"first_layer": 2, "last_layer": 3, "replicas": 1}]}
