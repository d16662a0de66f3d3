"""Profile, plan and run in one call; saved plans; plans that do not fit the model or the job."""
import functools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipetrain
from pipetrain.result import training_rate
from pipetrain.data import regression
from pipetrain.planning import Plan, StagePlan
from pt_models import mlp

ROOT = Path(__file__).resolve().parents[1]
ARGS = dict(loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.05),
            batch_size=8, shuffle=False, timeout=60)


def data():
    return regression(64, 4, 3)


@pytest.mark.multiprocess
def test_auto_profiles_plans_and_runs():
    result = pipetrain.train(mlp(), data(), stages="auto", workers=3, bandwidth="1Gbit", **ARGS)
    assert result.plan is not None and result.plan.workers == 3
    assert result.plan.num_layers == 7
    assert result.predicted_samples_per_s and result.predicted_samples_per_s > 0
    lcm = math.lcm(*result.plan.replicas)  # minibatches not filling a round of replicas are dropped
    assert len(result.history) == 8 // lcm * lcm and result.samples_per_s > 0
    assert set(result.phases) == {"capture_s", "profile_s", "setup_s", "plan_s", "memory_s", "start_s", "first_update_s"}
    assert result.history[0]["time"] - result.started >= sum(result.phases.values()) > 0
    assert len(result.peak_memory) == 3 and min(result.peak_memory) > 2**20


@pytest.mark.multiprocess
def test_auto_plans_a_straight_pipeline_for_a_schedule_that_cannot_replicate():
    # gpipe runs one worker per stage: the planner must not replicate a stage for it (it did, and the
    # prediction stopped the run with "runs straight pipelines only")
    result = pipetrain.train(mlp(), data(), stages="auto", workers=2, schedule=pipetrain.GPipe(microbatches=2), **ARGS)
    assert result.plan.replicas == [1, 1] and result.predicted_samples_per_s > 0
    assert result.samples_per_s > 0


@pytest.mark.multiprocess
def test_saved_plan_runs_with_replicas(tmp_path):
    path = tmp_path / "plan.json"
    Plan([StagePlan(0, 3, 2), StagePlan(4, 6, 1)], noam=2, stage_time_s=0.01, speedup_vs_one=1.5,
         speedup_vs_dp=1.1, options={"batch_size": 8}, samples_per_s=500.0).save(path)
    result = pipetrain.train(mlp(), data(), stages=str(path), **ARGS)
    assert result.plan.config == "2-1"
    assert result.predicted_samples_per_s == 500.0  # the figure `pipetrain plan` priced it at


@pytest.mark.multiprocess
def test_the_progress_bar_counts_every_minibatch_when_the_output_stage_is_replicated(tmp_path):
    # the bar's worker is one of the output stage's 2 replicas and records 1 update in 2: the bar ended
    # at 50% (the demo's 4 replicas: 110/440)
    path = tmp_path / "plan.json"
    Plan([StagePlan(0, 3, 1), StagePlan(4, 6, 2)], noam=2, stage_time_s=0.01, speedup_vs_one=1.5,
         speedup_vs_dp=1.1).save(path)
    r = subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", "examples.mlp_job:model", "--data",
                        "examples.mlp_job:data", "--plan", str(path), "--loss", "mse_loss", "--batch-size", "16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| 32/32 [" in r.stderr  # 512 items in minibatches of 16


def test_samples_per_s_counts_the_epochs_not_the_pauses_between_them():
    """Two replicas record 2 updates of 10 samples each per epoch; epoch 0 trains from t = 0 to 4 s and
    epoch 1, after a 6 s evaluation, from 10 to 13 s: 80 samples in 7 s of training."""
    def update(epoch, t, interval):
        return {"epoch": epoch, "time": t, "samples": 10, "samples_per_s": 10 / interval}
    records = [update(0, 1, 1), update(0, 2, 2), update(0, 3, 2), update(0, 4, 2),
               update(1, 11, 1), update(1, 12, 1.5), update(1, 12.5, 1.5), update(1, 13, 1)]
    assert training_rate(records) == pytest.approx(80 / 7)
    assert training_rate([]) == 0.0


def test_plan_for_another_model_or_more_workers_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    Plan([StagePlan(0, 3, 1), StagePlan(4, 8, 1)], noam=2, stage_time_s=0.01, speedup_vs_one=1.0,
         speedup_vs_dp=1.0).save(path)
    with pytest.raises(ValueError, match=f"{path}.*9 layers.*7"):
        pipetrain.train(mlp(), data(), stages=str(path), **ARGS)
    Plan([StagePlan(0, 3, 1), StagePlan(4, 6, 1)], noam=2, stage_time_s=0.01, speedup_vs_one=1.0,
         speedup_vs_dp=1.0).save(path)
    with pytest.raises(ValueError, match="places 2 workers but workers=4 was asked for"):
        pipetrain.train(mlp(), data(), stages=str(path), workers=4, **ARGS)
    with pytest.raises(ValueError, match="needs workers=N"):
        pipetrain.train(mlp(), data(), stages="auto", **ARGS)


@pytest.mark.multiprocess
def test_cli_plan_auto_prints_predicted_beside_measured():
    r = subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", "examples.mlp_job:model", "--data",
                        "examples.mlp_job:data", "--plan", "auto", "--workers", "2", "--loss", "mse_loss",
                        "--batch-size", "16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "samples/s: predicted" in r.stdout and "measured" in r.stdout
