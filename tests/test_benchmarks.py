"""The scripts in benchmarks/ run: sim_vs_real, dp_predictions and big_model end to end on small runs,
time_to_accuracy's and memory_prediction's arguments.

Their speeds are not checked (a tiny model on a shared machine says nothing); that they come out is, and
what they check of their results (big_model's saved model and its losses beside torch's).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_sim_vs_real_smoke_predicts_and_measures_every_schedule(tmp_path: Path) -> None:
    out = tmp_path / "svr.json"
    done = run("sim_vs_real.py", "--smoke", "--json", str(out), "--png-dir", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| schedule | predicted (A) | predicted (B) | measured samples/s |" in done.stdout
    report = json.loads(out.read_text())
    assert report["config"]["smoke"] is True
    rows = {r["schedule"]: r for r in report["rows"]}
    assert list(rows) == ["pipedream", "gpipe", "1f1b-flush", "model-parallel"]
    for r in rows.values():
        for key in ("predicted", "predicted_replay", "predicted_real_times", "measured"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["schedule"], key, r[key])
        assert len(r["budget_real"]) == len(r["budget_sim"]) == len(r["budget_replay"]) == 2
        assert len(r["predicted_runs"]) == len(r["measured_runs"]) == 2  # (A) from inputs taken per repetition
    assert [set(steps) for steps in report["setup_steps_ms"]] == [{"32", "8"}] * 2
    assert set(report["replay_ms"]) == set(rows) and all(len(v) == 2 for v in report["replay_ms"].values())
    assert all(Path(p).stat().st_size > 0 for p in report["pngs"])


def test_dp_predictions_smoke_predicts_and_measures_every_data_parallel_candidate(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    done = run("dp_predictions.py", "--smoke", "--json", str(out), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| model (workers, batch) | ddp | pipe-sgd |" in done.stdout
    rows = json.loads(out.read_text())["lstm-lm"]["rows"]
    assert set(rows) == {"ddp", "pipe-sgd", "pipe-sgd-trunc16", "pipe-sgd-quant8", "cgdp"}
    for name, r in rows.items():
        assert r["predicted"] > 0 and r["measured"] > 0 and len(r["runs"]) == len(r["predictions"]) == 1, name
        assert r["pairs"] in (0, 1) and r["predicted"] == r["predictions"][0], name
    assert rows["cgdp"]["options"][0]["chunk"] >= 1


def test_time_to_accuracy_parses_its_arguments() -> None:
    done = run("time_to_accuracy.py", "--help", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--wait-quiet" in done.stdout and "--attempts" in done.stdout


def test_memory_prediction_parses_its_arguments() -> None:
    done = run("memory_prediction.py", "--help", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--check" in done.stdout and "--steps" in done.stdout


def test_gpt2_real_reports_the_time_to_the_first_update_and_its_phases() -> None:
    done = run("gpt2_real.py", "--vocab", "64", "--width", "32", "--depth", "2", "--heads", "2", "--seq", "16",
               "--updates", "4", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # train's own lines (e.g. that a plan for fewer workers would run faster) may come before the report's
    first = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    phases = first["phases"]
    assert set(phases) == {"capture_s", "profile_s", "setup_s", "plan_s", "memory_s", "start_s", "first_update_s"}
    # the phases follow one another within the call's time to its first update
    assert 0 < sum(phases.values()) <= first["first_update_s"] + 1e-6
    assert first["updates"] == 4 and len(first["peak_memory_gib"]) == 2 and min(first["peak_memory_gib"]) > 0
    assert "| profile |" in done.stdout and "call -> first update" in done.stdout


def test_recompute_reports_the_stashed_bytes(tmp_path: Path) -> None:
    out = tmp_path / "recompute.json"
    done = run("recompute.py", "--repeats", "1", "--steps", "3", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["schedule"], r["recompute"]) for r in rows][:2] == [("pipedream", False), ("pipedream", True)]
    gpipe = [r for r in rows if r["schedule"] == "gpipe(m=4)"]
    assert gpipe[1]["activation_bytes"][0] < gpipe[0]["activation_bytes"][0]


def test_big_model_saves_the_trained_model_and_trains_as_torch_does(tmp_path: Path) -> None:
    out = tmp_path / "big.json"
    done = run("big_model.py", "--size", "tiny", "--workdir", str(tmp_path), "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| system | rank | peak memory GiB |" in done.stdout and "verdict: pipetrain <= torch" in done.stdout
    found = json.loads(out.read_text())
    check = found["loss_check"]
    # the saved model is the trained one: its loss is the probe step's, not the initial weights'
    assert abs(check["difference"]) < 1e-4 < abs(check["pipetrain"] - check["before_training"])
    ours, theirs = found["runs"]["pipetrain"][0], found["runs"]["torch"][0]
    assert ours["lrs"][-1] == 0 and ours["phases"]["save_s"] > 0 and len(ours["peak_memory"]) == 4
    # both systems trained the same job
    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["ranks"][-1]["losses"])) < 1e-4
    assert not (tmp_path / "tiny-trained").exists() and (tmp_path / "tiny" / "config.json").exists()


def test_scaling_strategies_prices_every_strategy_and_draws_them(tmp_path: Path) -> None:
    vgg16 = Path(__file__).resolve().parent.parent / "pipetrain" / "data" / "pipedream" / "vgg16.graph.txt"
    points = tmp_path / "points.jsonl"
    done = run("scaling_strategies.py", "--profiles", str(vgg16), "--workers", "8,16", "--bandwidths", "1Gbit",
               "--modes", "weak,strong", "--jsonl", str(points), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in points.read_text().splitlines()]
    assert [(r["mode"], r["workers"]) for r in rows] == [("weak", 8), ("weak", 16), ("strong", 8), ("strong", 16)]
    weak8 = rows[0]
    assert weak8["plan"] == "7-1 (8)" and set(weak8["rates"]) == {"pipeline", "ddp", "pipe-sgd", "pipe-sgd-trunc16",
                                                                 "pipe-sgd-quant8"}
    assert weak8["rates"]["pipeline"] > weak8["rates"]["ddp"] > 0  # heavy weights on a slow link
    drawn = tmp_path / "scaling.png"
    shown = run("scaling_strategies.py", "--table", str(points), "--png", str(drawn), timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "| vgg16 | weak | 1Gbit | " in shown.stdout and drawn.stat().st_size > 10_000


def test_replicated_plans_smoke_prices_and_runs_each_plan(tmp_path: Path) -> None:
    out = tmp_path / "rp.json"
    done = run("replicated_plans.py", "--smoke", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["configs"]) == {"3-1", "2-1-1"}
    for row in report["configs"].values():
        assert row["measured"] > 0 and row["simulated"] > 0 and row["paper"] > 0
        assert row["errors"]["simulated"] == pytest.approx(row["simulated"] / row["measured"] - 1)
    assert "| 3-1 (0," in done.stdout
