"""``log_dir``'s TensorBoard files, read back as TensorBoard reads them: every update's loss, learning
rate and rate, each epoch's evaluation, every rank's memory; a resumed run goes on in them; without
tensorboard a run warns once and writes metrics.jsonl alone."""
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import pipetrain
from pipetrain.errors import PipetrainWarning
from pipetrain.runtime.logs import MetricsLog
from launching import ROOT, free_port
from test_training_loop import BATCH, LR, N_MB, PIPELINE, STEP_LR, data, train

TORCHRUN_JOB = """
import functools, json, os, sys
import torch
import pipetrain
from pipetrain.data import regression
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
result = pipetrain.train(model, regression(64, 8, 4), loss_fn=torch.nn.functional.mse_loss, stages=[0, 2],
                         optimizer=functools.partial(torch.optim.SGD, lr=0.05), batch_size=16, log_dir=sys.argv[1])
if os.environ["RANK"] == "0":
    json.dump([h["loss"] for h in result.history], open(sys.argv[2], "w"))
"""


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve of a TensorBoard run (a directory's event files) as TensorBoard loads them:
    (step, value)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(run))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def f32(value: float) -> float:
    """``value`` as TensorBoard keeps it: a float32."""
    return float(np.float32(value))


def without_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``torch.utils.tensorboard`` fail to import here, as it does where tensorboard is not installed."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)


@pytest.mark.multiprocess
def test_tensorboard_has_every_update_each_epochs_evaluation_and_every_ranks_memory(tmp_path: Path) -> None:
    called = time.perf_counter()
    result = train(epochs=2, lr_scheduler=STEP_LR, eval_dataset=data(3 * BATCH, seed=9),
                   metrics={"accuracy": pipetrain.accuracy}, log_dir=tmp_path, **PIPELINE)
    elapsed = time.perf_counter() - called
    curves = scalars(tmp_path)
    history = result.history
    assert [h["step"] for h in history] == list(range(1, 2 * N_MB + 1))
    assert curves["train/loss"] == [(h["step"], f32(h["loss"])) for h in history]
    assert curves["train/lr"] == [(h["step"], f32(LR * 0.5 ** (t // 2))) for t, h in enumerate(history)]
    assert curves["train/samples_per_s"] == [(h["step"], f32(h["samples_per_s"])) for h in history]
    evals = [h for h in history if h["eval"] is not None]
    assert [h["step"] for h in evals] == [N_MB, 2 * N_MB]
    for name in ("loss", "accuracy"):
        assert curves[f"eval/{name}"] == [(h["step"], f32(h["eval"][name])) for h in evals]
    last, memory = history[-1]["step"], scalars(tmp_path / "memory")
    assert not any(tag.startswith("memory/") for tag in curves)
    for rank in (0, 1):
        assert memory[f"memory/peak_bytes/rank{rank}"] == [(last, f32(result.peak_memory[rank]))]
        for kind in ("activation_bytes", "weight_bytes"):
            assert memory[f"memory/stashed_{kind}/rank{rank}"] == [(last, f32(result.stashed_bytes[rank][kind]))]
    assert not any(tag.startswith("memory/peak_device_bytes") for tag in memory)  # trained on the CPU
    # metrics.jsonl's times: seconds since the call began, in order
    times = [r["time"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "update"]
    assert 0 < times[0] and times == sorted(times) and times[-1] < elapsed
    assert times == pytest.approx([h["time"] - called for h in history], abs=0.5)


@pytest.mark.multiprocess
def test_a_resumed_run_goes_on_in_the_same_curves(tmp_path: Path) -> None:
    logs, checkpoints = tmp_path / "logs", tmp_path / "ckpt"
    train(epochs=1, log_dir=logs, checkpoint_dir=checkpoints, **PIPELINE)
    result = train(epochs=2, log_dir=logs, checkpoint_dir=checkpoints, resume=True, **PIPELINE)
    assert [h["step"] for h in result.history] == list(range(1, 2 * N_MB + 1))
    assert scalars(logs)["train/loss"] == [(h["step"], f32(h["loss"])) for h in result.history]
    assert [step for step, _ in scalars(logs / "memory")["memory/peak_bytes/rank0"]] == [N_MB, 2 * N_MB]
    updates = [r for r in map(json.loads, (logs / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "update"]
    assert [r["loss"] for r in updates] == [h["loss"] for h in result.history]
    # a new run starts its logs afresh
    train(epochs=1, log_dir=logs, **PIPELINE)
    assert [step for step, _ in scalars(logs)["train/loss"]] == list(range(1, N_MB + 1))
    assert [step for step, _ in scalars(logs / "memory")["memory/peak_bytes/rank0"]] == [N_MB]


@pytest.mark.multiprocess
def test_under_torchrun_the_output_stages_rank_writes_the_curves_and_rank_0_the_memory(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(TORCHRUN_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), str(tmp_path / "job.py"), str(tmp_path / "logs"), str(tmp_path / "losses")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    losses = json.loads((tmp_path / "losses").read_text())
    assert scalars(tmp_path / "logs")["train/loss"] == [(t + 1, f32(loss)) for t, loss in enumerate(losses)]
    assert sorted(scalars(tmp_path / "logs" / "memory")) == [f"memory/{what}/rank{rank}" for what in (
        "peak_bytes", "stashed_activation_bytes", "stashed_weight_bytes") for rank in (0, 1)]


@pytest.mark.multiprocess
def test_without_tensorboard_a_run_warns_once_and_writes_the_json_lines(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    without_tensorboard(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(epochs=1, log_dir=tmp_path, **PIPELINE)
    said = [str(w.message) for w in caught if issubclass(w.category, PipetrainWarning)]
    assert len(said) == 1 and "install pipetrain[tensorboard]" in said[0], said
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == [h["loss"] for h in result.history]
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_the_metrics_log_writes_json_lines_without_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    without_tensorboard(monkeypatch)
    log = MetricsLog(tmp_path, began=100.0, board=True, total_steps=4)
    log.update({"step": 1, "loss": 0.5, "lr": 0.1, "samples_per_s": 8.0, "time": 102.5})
    log.evaluation(0, 1, {"loss": 0.25}, jsonl=True)
    log.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"kind": "update", "step": 1, "loss": 0.5, "lr": 0.1, "samples_per_s": 8.0, "time": 2.5, "total_steps": 4},
        {"kind": "eval", "epoch": 0, "step": 1, "loss": 0.25}]
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_steps_trained_again_after_a_restart_are_drawn_once(tmp_path: Path) -> None:
    """A restarted run's writer hides what an earlier one wrote from its first step on."""
    pytest.importorskip("tensorboard")
    for first, value in ((1, 1.0), (3, 2.0)):
        log = MetricsLog(tmp_path, began=0.0, board=True, purge_step=first)
        for step in range(first, 5):
            log.update({"step": step, "loss": value, "lr": None, "samples_per_s": 1.0, "time": 0.0})
        log.close()
    assert scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0)]
    assert "train/lr" not in scalars(tmp_path)
