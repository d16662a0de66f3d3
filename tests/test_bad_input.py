"""Bad input, a table of cases: each gives a one-line error that names what is wrong, none hangs, and
none leaves a process behind."""
import functools
import json
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import pipetrain
from pipetrain.data import regression
from pipetrain.planning import Plan, StagePlan
from pipetrain.runtime import launch
from launching import ROOT
from pt_models import mlp

MSE = torch.nn.functional.mse_loss
SGD = functools.partial(torch.optim.SGD, lr=0.05)


def train(**kw):
    args = dict(model=mlp(), dataset=regression(32, 4, 3), loss_fn=MSE, optimizer=SGD, stages=[0, 2, 4, 6],
                batch_size=4, shuffle=False, timeout=30)
    args.update(kw)
    return pipetrain.train(args.pop("model"), args.pop("dataset"), **args)


class Triples(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), i


class Growing(Dataset):
    """Items of minibatch 0 (batch 4) have 4 features, later ones 5."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.zeros(4 if i < 4 else 5, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)


class Unreadable(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        raise KeyError(i)


def per_sample_mse(output, target):
    return MSE(output, target, reduction="none")


def _truncated_profile(tmp: Path) -> None:
    f = tmp / "p.json"
    text = json.dumps({"format": "pipetrain-profile", "version": 1, "batch_size": 4, "device": "cpu", "layers": [
        {"name": "a", "forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 8, "parameter_bytes": 8}]})
    f.write_text(text[:len(text) // 2])
    pipetrain.Profile.load(f)


def _edgeless_graph(tmp: Path) -> None:
    f = tmp / "graph.txt"
    f.write_text("node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, activation_size=8.0, "
                 "parameter_size=0.0\nnode2 -- Linear -- forward_compute_time=1.0, backward_compute_time=1.0, "
                 "activation_size=8.0, parameter_size=8.0\n")
    pipetrain.Profile.load(f)


def _plan_file(tmp: Path, **change) -> Path:
    plan = Plan([StagePlan(0, 4, 1), StagePlan(5, 9, 1)], noam=2, stage_time_s=1.0, speedup_vs_one=1.0,
                speedup_vs_dp=1.0)
    f = tmp / "plan.json"
    plan.save(f)
    data = json.loads(f.read_text())
    data.update(change)
    f.write_text(json.dumps(data))
    return f


def _other_models_checkpoint(tmp: Path) -> None:
    train(strategy="ddp", stages=None, workers=2, checkpoint_dir=tmp, epochs=1)
    other = torch.nn.Sequential(*list(mlp())[:-1], torch.nn.Linear(6, 3, bias=False)).double()
    train(model=other, strategy="pipe-sgd", stages=None, workers=2, checkpoint_dir=tmp, resume=True)


def _port_in_use(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setattr(launch, "_free_port", lambda: busy.getsockname()[1])
        train()


# (case, what it does given a temporary directory and monkeypatch, what the error must say)
API_CASES = [
    ("truncated profile JSON", lambda t, m: _truncated_profile(t), r"p\.json: not valid JSON \(truncated\?\)"),
    ("graph.txt without edges", lambda t, m: _edgeless_graph(t), r"graph\.txt: has 2 nodes but no edges"),
    ("plan for another layer count", lambda t, m: train(stages=str(_plan_file(t))),
     r"plan\.json: made for a model of 10 layers but this model has 7"),
    ("plan from a newer version", lambda t, m: train(stages=str(_plan_file(t, version=9))),
     r"written by a newer pipetrain"),
    ("dataset items are triples", lambda t, m: train(dataset=Triples()),
     r"must be \(input, target\) pairs or dictionaries, but item 0 is a tuple of 3"),
    ("dataset cannot be read", lambda t, m: train(dataset=Unreadable()), r"the dataset cannot be read \(KeyError"),
    ("inputs change shape", lambda t, m: train(dataset=Growing()),
     r"stage 0 \(rank 0\): minibatch 1's inputs have shape \(4, 5\) but the first minibatch's had \(4, 4\)"),
    ("loss is not a scalar", lambda t, m: train(loss_fn=per_sample_mse),
     r"stage 3 \(rank 3\): loss_fn returned a tensor of shape \(4, 3\) .* not a scalar tensor"),
    ("output the loss cannot take", lambda t, m: train(loss_fn=torch.nn.functional.nll_loss),
     r"stage 3 \(rank 3\): loss_fn\(output, target\) failed on minibatch 0: RuntimeError"),
    ("fractional stage boundary", lambda t, m: train(stages=[0, 2.5, 4]), r"give the first layer index of each "
                                                                          r"stage as integers"),
    ("no stages", lambda t, m: train(stages=None), r"strategy='pipeline' needs stages"),
    ("workers beside explicit stages", lambda t, m: train(workers=8), r"workers=8 is given beside explicit stages"),
    ("bandwidth beside explicit stages", lambda t, m: train(bandwidth="1Gbit"), r"bandwidth='1Gbit' is only used"),
    ("zero threads", lambda t, m: train(threads=0), r"threads=0: give the torch threads per worker"),
    ("zero timeout", lambda t, m: train(timeout=0), r"timeout=0: give the seconds"),
    ("optimizer not callable", lambda t, m: train(optimizer="sgd"), r"optimizer='sgd' is not callable"),
    ("loss not callable", lambda t, m: train(loss_fn="mse"), r"loss_fn='mse' is not callable"),
    ("model not a module", lambda t, m: train(model="mlp"), r"model is a str, not a torch.nn.Module"),
    ("zero epochs", lambda t, m: train(epochs=0), r"batch_size and epochs must be integers >= 1"),
    ("batch larger than the dataset", lambda t, m: train(batch_size=64), r"the dataset has 32 items, fewer than"),
    ("unwritable checkpoint dir", lambda t, m: train(checkpoint_dir=Path(__file__) / "ckpt"),
     r"checkpoint_dir '.*test_bad_input\.py/ckpt' is not usable \(Not a directory\)"),
    ("resume without checkpoint dir", lambda t, m: train(resume=True), r"resume=True needs checkpoint_dir"),
    ("restarts without checkpoint dir", lambda t, m: train(max_restarts=2), r"max_restarts needs checkpoint_dir"),
    ("checkpoint of another model", lambda t, m: _other_models_checkpoint(t),
     r"belongs to another job \(model: saved [0-9a-f]+, this job [0-9a-f]+\); resume with the same model"),
    ("port already in use", _port_in_use, r"port \d+ on 127\.0\.0\.1 is in use .* 3 times"),
    ("strategy auto: model and data of two dtypes", lambda t, m: train(model=mlp().float(), stages=None,
                                                                       strategy="auto", workers=2),
     r"^the model failed on the dataset's first minibatch while pipetrain profiled it to plan: RuntimeError: "
     r"mat1 and mat2 must have the same dtype.*; check that the model, the loss and the dataset's samples fit"),
    ("stages auto: model and data of two dtypes", lambda t, m: train(model=mlp().float(), stages="auto", workers=2),
     r"^the model failed on the dataset's first minibatch while pipetrain profiled it to plan: RuntimeError"),
]
IN_WORKERS = {"inputs change shape", "loss is not a scalar", "output the loss cannot take",
              "checkpoint of another model", "port already in use"}
"""The cases whose error comes from the workers (or a job run first): they start processes."""


def _processes_below(pid: int) -> dict[int, str]:
    """pid -> command line of every process below ``pid``."""
    parent, cmd = {}, {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for child in [c for c, pp in parent.items() if pp == p]:
            found[child] = cmd.get(child, "")
            todo.append(child)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("case,run,message", [
    pytest.param(*c, id=c[0], marks=[pytest.mark.multiprocess] if c[0] in IN_WORKERS else []) for c in API_CASES])
def test_bad_input_is_one_line_and_leaves_nothing_behind(tmp_path, monkeypatch, case, run, message) -> None:
    with pytest.raises((ValueError, RuntimeError)) as raised:
        run(tmp_path, monkeypatch)
    text = str(raised.value)
    assert "\n" not in text, text
    assert re.search(message, text), text
    # multiprocessing's fork server and resource tracker, and pipetrain's cleaner, stay for the next job
    # (they end with this process); no worker is left
    left = {p: c for p, c in _processes_below(os.getpid()).items()
            if not any(s in c for s in ("multiprocessing.forkserver", "multiprocessing.resource_tracker",
                                        "pipetrain's cleaner"))}
    assert left == {}


def cli(*args: str, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, str]:
    """Run the command with a marker in its environment: (the result, the marker)."""
    marker = uuid.uuid4().hex
    env = {**os.environ, "PIPETRAIN_TEST_CASE": marker, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "pipetrain.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=120, env=env)
    return r, marker


def _marked(marker: str) -> list[int]:
    """Processes still running with ``marker`` in their environment."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"PIPETRAIN_TEST_CASE={marker}".encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


JOB = ("examples.mlp_job:model", "--data", "examples.mlp_job:data", "--loss", "mse_loss")
CLI_CASES = [
    ("module does not import", ("train", "nosuch:model", *JOB[1:], "--stages", "0"), r"cannot import 'nosuch'"),
    ("factory of the wrong type", ("train", "examples.mlp_job:data", *JOB[1:], "--stages", "0"),
     r"examples.mlp_job:data gave a TensorDataset, not a torch.nn.Module"),
    ("module with a syntax error", ("train", "broken:model", *JOB[1:], "--stages", "0"),
     r"cannot import 'broken' .*invalid syntax .*broken\.py, line 1"),
    ("empty --stages", ("train", *JOB, "--stages", ""), r"--stages '': give the first layer index"),
    ("no --loss", ("train", *JOB[:3], "--stages", "0,2"), r"the following arguments are required: --loss"),
    ("--save under a file", ("train", *JOB, "--stages", "0,2", "--save", "README.md/model.pt"),
     r"save='README.md/model.pt': README.md is a file, not a directory"),
    ("profile of zero samples", ("profile", "examples.mlp_job:model", "--batch-size", "0", "--input-shape", "8"),
     r"--batch-size"),
    ("simulate zero minibatches", ("simulate", "pipetrain/data/pipedream/vgg16.graph.txt", "--stages", "0,10",
                                   "--minibatches", "0"), r"--minibatches"),
]


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("case,args,message", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_command_line_is_one_line_and_leaves_nothing_behind(tmp_path, case, args, message) -> None:
    (tmp_path / "broken.py").write_text("def model(:\n")
    (tmp_path / "README.md").write_text("")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "pipetrain").symlink_to(ROOT / "pipetrain")
    r, marker = cli(*args, cwd=tmp_path)
    assert r.returncode in (1, 2), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(message, r.stderr), r.stderr
    assert _marked(marker) == []


def test_a_foreign_error_is_reported_by_its_first_line_or_its_type() -> None:
    from pipetrain.errors import first_line, one_line
    assert first_line(ValueError("  shape mismatch\nat layer 3\n")) == "shape mismatch"
    assert first_line(ValueError("x" * 300)) == "x" * 200 and first_line(ValueError("x" * 300), None) == "x" * 300
    assert first_line(OSError()) == "OSError" and one_line(OSError()) == "OSError"
    assert one_line(KeyError("w")) == "KeyError: 'w'"


def test_an_error_without_a_message_still_ends_the_command_in_one_line(monkeypatch, capsys) -> None:
    """An error whose message is empty ends the command in one line too (its type), not in an IndexError's
    traceback from taking the first of no lines."""
    from pipetrain import cli
    from pipetrain.cli import train as train_command

    def fail(args: object) -> None:
        raise OSError()

    monkeypatch.setattr(train_command, "cmd_plot", fail)
    assert cli.main(["plot", "metrics.jsonl"]) == 1
    assert capsys.readouterr().err == "pipetrain plot: error: OSError\n"
