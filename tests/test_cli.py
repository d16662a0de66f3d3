"""The command line and the torchrun path, run as a user would."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launching import ROOT, free_port, run_locally

pytestmark = pytest.mark.multiprocess


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipetrain.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_train_from_factories(tmp_path):
    out = tmp_path / "model.pt"
    r = cli("train", "examples.mlp_job:model", "--data", "examples.mlp_job:data", "--stages", "0,4",
            "--loss", "mse_loss", "--batch-size", "16", "--epochs", "2", "--save", str(out))
    assert r.returncode == 0, r.stderr
    assert "final loss" in r.stdout and "samples/s" in r.stdout
    assert "0.weight" in torch.load(out, weights_only=True)


def test_bad_input_is_one_line():
    r = cli("train", "examples.mlp_job:model", "--data", "examples.mlp_job:data", "--stages", "0,9", "--loss", "mse_loss")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "below the layer count 7" in r.stderr
    r = cli("train", "nosuchmodule:model", "--data", "examples.mlp_job:data", "--stages", "0", "--loss", "mse_loss")
    assert r.returncode == 1 and "cannot import 'nosuchmodule'" in r.stderr


def test_resume_with_nothing_left_to_train(tmp_path):
    job = ("train", "examples.mlp_job:model", "--data", "examples.mlp_job:data", "--stages", "0,4", "--loss",
           "mse_loss", "--batch-size", "16", "--checkpoint-dir", str(tmp_path), "--save", str(tmp_path / "a.pt"))
    assert cli(*job).returncode == 0
    r = cli(*job[:-1], str(tmp_path / "b.pt"), "--resume")
    assert r.returncode == 0, r.stderr
    assert "nothing left to train" in r.stdout and "samples/s" not in r.stdout
    assert r.stderr.strip().startswith("pipetrain: warning: every requested epoch (up to 0) is already saved")
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("a.pt", "b.pt"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ctrl_c_stops_every_worker_in_one_line(tmp_path):
    """SIGINT to the whole foreground group, as a terminal sends it: one line, exit 130, nothing left."""
    import signal
    import time
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "pipetrain.cli", "train", "examples.mlp_job:model", "--data",
                             "examples.mlp_job:data", "--stages", "0,4", "--loss", "mse_loss", "--epochs", "100000"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            # as from a terminal: a runner that ignores SIGINT (a background job) passes that on
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("pipetrain-*/job-*/history*.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)  # until the workers train
    streaming = bool(list(tmp_path.glob("pipetrain-*/job-*/history*.jsonl")))
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert streaming, f"no worker streamed its history within 60 s: {sorted(p.name for p in tmp_path.rglob('*'))}"
    assert proc.returncode == 130, (out[-500:], err[-2000:])
    said = [line for line in err.splitlines() if line.strip() and not line.startswith("pipetrain:  ")]  # bars
    assert said[-1].startswith("pipetrain train: interrupted; the workers were stopped"), err[-2000:]
    assert "Traceback" not in err
    time.sleep(1)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("pipetrain-", "pymp-"))] == []


def test_demo_trains_well_above_chance():
    r = cli("demo", "--epochs", "6")
    assert r.returncode == 0, r.stderr
    acc = float(r.stdout.split("held-out accuracy ")[1].split("%")[0])
    assert acc > 70.0, r.stdout


@pytest.mark.parametrize("strategy", ["pipeline", "pipe-sgd"])
def test_torchrun_matches_local_launch(tmp_path, strategy):
    """Under torchrun each process runs as its rank; the result equals a locally launched run."""
    env = {**os.environ, "PIPETRAIN_EXAMPLE_OUT": str(tmp_path / "torchrun.pt")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), "examples/mlp_job.py", "--strategy", strategy], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    a = torch.load(tmp_path / "torchrun.pt", weights_only=True)
    b = run_locally(strategy, tmp_path / "local.pt", 2)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_cli_modules_import_alone_and_none_imports_back():
    """Each module of ``pipetrain.cli`` imports on its own, and no module-level import goes round a circle."""
    package = ROOT / "pipetrain" / "cli"
    names = {p.stem: "pipetrain.cli" if p.stem == "__init__" else f"pipetrain.cli.{p.stem}"
             for p in package.glob("*.py")}
    edges: dict[str, set[str]] = {}
    for stem, name in names.items():
        edges[name] = set()
        for node in ast.parse((package / f"{stem}.py").read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module == "pipetrain.cli":
                edges[name] |= {names.get(a.name, "pipetrain.cli") for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipetrain.cli."):
                edges[name].add(node.module)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges.get(start, ()))

    assert [n for n in edges if reaches(n, n, set())] == []
    assert not any("pipetrain.cli" in edges[n] for n in ("pipetrain.cli.common", "pipetrain.cli.train",
                                                         "pipetrain.cli.planning"))
    code = ("import importlib, sys\n"
            "for m in ('pipetrain.cli.common', 'pipetrain.cli.train', 'pipetrain.cli.planning', 'pipetrain.cli'):\n"
            "    for k in [k for k in sys.modules if k.startswith('pipetrain.cli')]:\n"
            "        del sys.modules[k]\n"
            "    importlib.import_module(m)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
