"""A killed worker is survived: the job restarts from its checkpoints and ends exactly where an
uninterrupted job ends, for every strategy."""
import functools
import json
import random
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.data import regression
from pipetrain.planning import Plan, StagePlan
from pipetrain.runtime import checkpoint
from launching import ROOT, free_port
from pt_models import KillOnce, mlp

EPOCHS, BATCH, N_MB = 3, 6, 12
# a pipeline of 4 stages, each starting with a KillOnce; stage 1 holds a dropout (random state restored)
STAGES = [0, 3, 7, 10]
LAYOUTS = {
    "pipeline": dict(stages=STAGES),
    "pipeline-replicated": dict(stages=Plan([StagePlan(0, 2, 2), StagePlan(3, 6, 1), StagePlan(7, 9, 1),
                                             StagePlan(10, 11, 1)], noam=3, stage_time_s=1.0, speedup_vs_one=1.0,
                                            speedup_vs_dp=1.0)),
    "ddp": dict(strategy="ddp", workers=2),
    "pipe-sgd": dict(strategy=pipetrain.PipeSGD(staleness=2), workers=3),
    "cgdp": dict(strategy="cgdp", workers=2),
}


def world(layout: str) -> int:
    how = LAYOUTS[layout]
    if "workers" in how:
        return how["workers"]
    return how["stages"].workers if isinstance(how["stages"], Plan) else len(how["stages"])


def forwards_per_epoch(layout: str, rank: int) -> int:
    """Training forwards the KillOnce on ``rank`` sees per epoch: a replica of stage 0 takes every other minibatch."""
    return N_MB // 2 if layout == "pipeline-replicated" and rank < 2 else N_MB


def model(layout: str, rank: int = -1, at: int = 0, marker: str = "", when: str = "forward",
          sig: int = signal.SIGKILL) -> nn.Sequential:
    """The exactness MLP (float64) with a dropout, and KillOnce layers that kill (``sig``) ``rank`` once."""
    kill = functools.partial(KillOnce, rank, at, marker, when, sig)
    l0, t0, l1, t1, l2, t2, l3 = mlp()
    if layout.startswith("pipeline"):
        layers = [kill(), l0, t0, kill(), l1, nn.Dropout(0.25), t1, kill(), l2, t2, kill(), l3]
    else:
        layers = [kill(), l0, t0, l1, nn.Dropout(0.25), t1, l2, t2, l3]
    return nn.Sequential(*layers)


def train(net: nn.Module, layout: str, epochs: int = EPOCHS, **kw) -> pipetrain.TrainResult:
    return pipetrain.train(net, regression(N_MB * BATCH, 4, 3), loss_fn=torch.nn.functional.mse_loss,
                           optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5), batch_size=BATCH,
                           epochs=epochs, shuffle=True, seed=3, **{"timeout": 60, **LAYOUTS[layout], **kw})


@functools.cache
def uninterrupted(layout: str) -> dict[str, torch.Tensor]:
    return train(model(layout), layout).model.state_dict()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float64
        assert (a[k] - b[k]).abs().max().item() <= 1e-9, k


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", ["forward", "save"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_worker_is_survived_with_nothing_lost(tmp_path, layout: str, when: str) -> None:
    """SIGKILL a random worker in the middle of epoch 1 (or while it saves epoch 1): the job restarts
    every worker after epoch 0, exits normally, and its weights and history are those of an
    uninterrupted run."""
    rank = random.Random(f"{layout}/{when}").randrange(world(layout))
    per_epoch = forwards_per_epoch(layout, rank)
    at = per_epoch + per_epoch // 2 if when == "forward" else 2 * per_epoch
    marker = tmp_path / "killed"
    with pytest.warns(pipetrain.PipetrainWarning, match=r"was killed by SIGKILL.*restarting every worker after "
                                                        r"epoch 0 \(1 of 2 restarts\)"):
        result = train(model(layout, rank, at, str(marker), when), layout, checkpoint_dir=tmp_path / "ckpt",
                       max_restarts=2)
    assert marker.exists(), "the worker was never killed"
    assert_same_weights(result.model.state_dict(), uninterrupted(layout))
    assert [h["step"] for h in result.history] == list(range(1, EPOCHS * N_MB + 1))  # one record per update
    assert [h["attempt"] for h in result.history] == [0] * N_MB + [1] * (EPOCHS - 1) * N_MB
    assert [(r["attempt"], r["resumed_after_epoch"]) for r in result.restarts] == [(0, 0)]
    assert f"(rank {rank})" in result.restarts[0]["error"] or f"worker {rank} " in result.restarts[0]["error"]
    assert result.epochs_trained == EPOCHS


@pytest.mark.multiprocess
def test_a_kill_before_the_first_checkpoint_restarts_from_scratch(tmp_path) -> None:
    marker = tmp_path / "killed"
    with pytest.warns(pipetrain.PipetrainWarning, match="restarting every worker from the start"):
        result = train(model("pipeline", 2, 5, str(marker)), "pipeline", checkpoint_dir=tmp_path / "ckpt",
                       max_restarts=1)
    assert marker.exists()
    assert_same_weights(result.model.state_dict(), uninterrupted("pipeline"))
    assert [h["step"] for h in result.history] == list(range(1, EPOCHS * N_MB + 1))
    assert result.restarts[0]["resumed_after_epoch"] is None


@pytest.mark.multiprocess
def test_out_of_restarts_raises_with_history_and_checkpoint(tmp_path) -> None:
    """With no restart left the error is raised as before, carrying the history and the kept epoch."""
    with pytest.raises(pipetrain.PipetrainError, match=r"stage 2 \(rank 2\) was killed by SIGKILL") as failed:
        train(model("pipeline", 2, N_MB + 4, str(tmp_path / "killed")), "pipeline", checkpoint_dir=tmp_path / "ckpt")
    e = failed.value
    assert e.kind == "died" and e.rank == 2 and e.checkpoint_epoch == 0
    steps = [h["step"] for h in e.history]
    assert steps[:N_MB] == list(range(1, N_MB + 1)) and steps == sorted(set(steps))  # epoch 0, then what streamed
    assert N_MB <= len(steps) < 2 * N_MB


@pytest.mark.multiprocess
@pytest.mark.parametrize("damage", ["no manifest", "truncated", "corrupt"])
def test_a_checkpoint_cut_short_is_skipped(tmp_path, damage: str) -> None:
    """What a kill while writing leaves (the manifest is written last; a torn file fails its checksum):
    the resumed job warns, naming the file, and goes on from the previous epoch, ending exactly."""
    ckpt = tmp_path / "ckpt"
    train(model("pipe-sgd"), "pipe-sgd", epochs=2, checkpoint_dir=ckpt)
    state = checkpoint.path(ckpt, 1, 1)
    if damage == "no manifest":
        checkpoint.manifest_path(ckpt, 1, 1).unlink()
        state.with_name(state.name + ".tmp").write_bytes(state.read_bytes()[:100])  # the next save's torn temp
    elif damage == "truncated":
        state.write_bytes(state.read_bytes()[:-10])
    else:
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        result = train(model("pipe-sgd"), "pipe-sgd", checkpoint_dir=ckpt, resume=True)
    said = [str(w.message) for w in said if w.category is pipetrain.PipetrainWarning]
    if damage == "no manifest":  # epoch 1 of worker 1 was never saved: nothing to warn about
        assert said == []
    else:
        assert len(said) == 1 and re.match(rf"{state} is {damage} .*; skipping epoch 1", said[0]), said
    assert result.epochs_trained == EPOCHS - 1  # epochs 1 and 2, after epoch 0
    assert_same_weights(result.model.state_dict(), uninterrupted("pipe-sgd"))
    assert [h["step"] for h in result.history] == list(range(1, EPOCHS * N_MB + 1))


@pytest.mark.multiprocess
def test_resume_with_nothing_left_returns_the_checkpointed_model(tmp_path) -> None:
    done = train(model("ddp"), "ddp", checkpoint_dir=tmp_path)
    for _ in range(3):  # never a crash, never "loss nan"
        with pytest.warns(pipetrain.PipetrainWarning, match="nothing left to train"):
            again = train(model("ddp"), "ddp", checkpoint_dir=tmp_path, resume=True)
        assert again.epochs_trained == 0
        assert_same_weights(again.model.state_dict(), done.model.state_dict())
        assert again.history == done.history


def test_max_restarts_needs_a_checkpoint_dir() -> None:
    with pytest.raises(ValueError, match="max_restarts needs checkpoint_dir"):
        train(model("ddp"), "ddp", max_restarts=1)
    with pytest.raises(ValueError, match="max_restarts=-1"):
        train(model("ddp"), "ddp", max_restarts=-1)



@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["pipeline", "pipe-sgd"])
def test_torchrun_restarted_ranks_resume_by_themselves(tmp_path, layout: str) -> None:
    """Under ``torchrun --max-restarts 1`` a killed rank makes torchrun restart every rank; each resumes
    from checkpoint_dir on its own and the job ends as an uninterrupted one."""
    rank, per_epoch = world(layout) - 1, N_MB
    out = tmp_path / "model.pt"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world(layout)),
                        "--max-restarts", "1", "--master-port", str(free_port()), "tests/restart_job.py", layout,
                        str(rank), str(per_epoch + per_epoch // 2), str(tmp_path / "killed"), str(tmp_path / "ckpt"),
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "killed").exists()
    assert_same_weights(torch.load(out, weights_only=True), uninterrupted(layout))
    history = json.loads(out.with_name(out.name + ".json").read_text())
    assert [h["step"] for h in history] == list(range(1, EPOCHS * N_MB + 1))
    assert [h["attempt"] for h in history] == [0] * N_MB + [1] * (EPOCHS - 1) * N_MB


@pytest.mark.multiprocess
def test_a_stopped_worker_is_named_within_seconds_and_the_job_restarts(tmp_path) -> None:
    """SIGSTOP stage 2 of 4 with the default timeout (300 s): the heartbeat names it, not a neighbour
    waiting on it, within SILENT_AFTER_S; the job restarts and ends exactly."""
    from pipetrain.api import SILENT_AFTER_S

    marker = tmp_path / "stopped"
    t0 = time.monotonic()
    with pytest.warns(pipetrain.PipetrainWarning, match=r"^stage 2 \(rank 2\) went silent: no sign of life for"):
        result = train(model("pipeline", 2, N_MB + 3, str(marker), sig=signal.SIGSTOP), "pipeline",
                       checkpoint_dir=tmp_path / "ckpt", max_restarts=1, timeout=300)
    assert marker.exists()
    assert time.monotonic() - t0 < SILENT_AFTER_S + 30
    assert_same_weights(result.model.state_dict(), uninterrupted("pipeline"))
    assert [h["step"] for h in result.history] == list(range(1, EPOCHS * N_MB + 1))
