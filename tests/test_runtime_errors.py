"""Bad input gets a one-line error before any process starts; dead or silent peers fail, never hang."""
import functools
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.data import regression
from pipetrain.errors import PipetrainError
from pipetrain.registry import make
from pipetrain.runtime.launch import _spawn_once, spawn
from pt_models import FaultAt, Untraceable, mlp, nan_loss

SGD = functools.partial(torch.optim.SGD, lr=0.05)
MSE = torch.nn.functional.mse_loss


def train(model=None, **kw):
    args = dict(loss_fn=MSE, optimizer=SGD, stages=[0, 2, 4, 6], batch_size=4, shuffle=False, timeout=30)
    args.update(kw)
    return pipetrain.train(model if model is not None else mlp(), regression(48, 4, 3), **args)


@pytest.mark.parametrize("stages,match", [
    ([1, 3], "first stage must start at layer 0"),
    ([0, 4, 2], "must increase strictly"),
    ([0, 9], "below the layer count 7"),
    (list(range(8)), "8 stages but the model has only 7 layers"),
])
def test_bad_stage_boundaries(stages, match):
    with pytest.raises(ValueError, match=match):
        train(stages=stages)


def test_batch_not_divisible_by_microbatches():
    with pytest.raises(ValueError, match="batch_size 4 is not divisible by microbatches 3"):
        train(schedule=pipetrain.GPipe(microbatches=3))


def test_unknown_schedule_and_misplaced_options():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        train(schedule="zigzag")
    with pytest.raises(ValueError, match="vertical_sync applies to schedule 'pipedream', not 'gpipe'"):
        make("schedule", "gpipe", {"vertical_sync": True})
    with pytest.raises(ValueError, match="microbatches applies to schedule 'gpipe' or '1f1b-flush'( or '[^']+')*, not 'pipedream'"):
        make("schedule", "pipedream", {"microbatches": 2})
    with pytest.raises(ValueError, match="microbatches=0 must be an integer >= 1"):
        pipetrain.GPipe(microbatches=0)


def test_world_size_must_match_the_stages(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="torchrun started 3 workers but stages=\\[0, 2, 4, 6\\] needs 4"):
        train()


def test_untraceable_model_says_to_pass_a_sequential():
    with pytest.raises(pipetrain.LayerError, match="pass an nn.Sequential"):
        train(model=Untraceable(), stages=[0])


@pytest.mark.multiprocess
def test_non_finite_loss_stops_and_keeps_the_checkpoint(tmp_path):
    train(checkpoint_dir=tmp_path, epochs=1)
    saved = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(pipetrain.PipetrainError, match="loss is nan at epoch 1 minibatch 0.*checkpoint of epoch 0 .* "
                       "is kept") as failed:
        train(checkpoint_dir=tmp_path, resume=True, epochs=3, loss_fn=nan_loss)
    assert failed.value.checkpoint_epoch == 0 and failed.value.log.parent == tmp_path  # the tracebacks, beside
    assert sorted(p.name for p in tmp_path.iterdir() if p != failed.value.log) == saved


def with_fault(fault: nn.Module) -> nn.Sequential:
    """The exactness MLP with ``fault`` inserted as layer 2, at the start of stage 1 (rank 1)."""
    layers = list(mlp())
    return nn.Sequential(*layers[:2], fault, *layers[2:])


@pytest.mark.multiprocess
def test_dead_peer_is_named():
    t0 = time.monotonic()
    with pytest.raises(pipetrain.PipetrainError, match=r"stage 1 \(rank 1\)"):
        train(model=with_fault(FaultAt(3, "die")), stages=[0, 2, 5, 7])
    assert time.monotonic() - t0 < 30


@pytest.mark.multiprocess
def test_silent_peer_times_out_and_is_named():
    t0 = time.monotonic()
    with pytest.raises(pipetrain.PipetrainError, match=r"stage 1 \(rank 1\) went silent: nothing for 3s"):
        train(model=with_fault(FaultAt(3, "hang")), stages=[0, 2, 5, 7], timeout=3)
    assert time.monotonic() - t0 < 30  # and no process is left: spawn() kills them before raising



def _wait_forever(holds_the_gil: int | None) -> None:
    """A worker that never returns: asleep with the GIL free (its heartbeat goes on), or, as rank
    ``holds_the_gil``, in a C call that holds the GIL (its heartbeat stops)."""
    if holds_the_gil == int(os.environ["RANK"]):
        import ctypes
        ctypes.PyDLL(None).sleep(60)  # libc's sleep(3); PyDLL keeps the GIL through the call
    while True:
        time.sleep(1)


@pytest.mark.multiprocess
def test_a_job_past_its_time_limit_is_stopped_with_every_workers_stack(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(PipetrainError, match=r"^rank 0, rank 1 still running after 3s, the job's time limit; the "
                       r"workers were stopped \(Python stacks: .*pipetrain-stacks-") as e:
        spawn(_wait_forever, 2, (None,), timeout=3, log_dir=tmp_path)
    assert time.monotonic() - t0 < 20
    assert e.value.kind == "timeout" and e.value.log.parent == tmp_path
    stacks = e.value.log.read_text().split("== rank ")[1:]
    assert [s.split("\n")[0] for s in stacks] == ["0", "1"]
    assert all("in _wait_forever" in s for s in stacks)


class _ExitsWhenFirstSeen:
    """A worker process stand-in: it writes its result when started and has exited by the second time
    its exit code is read, so the launcher's loop sees it running and its time-limit check does not."""

    def __init__(self, target, args, daemon):
        self.rank, self.workdir, self.reads, self.pid = args[0], args[3], 0, 0

    def start(self):
        torch.save({"rank": self.rank}, Path(self.workdir) / f"result{self.rank}.pt")

    @property
    def exitcode(self):
        self.reads += 1
        return None if self.reads == 1 else 0

    def join(self, timeout=None):
        pass


class _DiesWhileStarted(_ExitsWhenFirstSeen):
    """A worker process that dies while the launcher still hands it its task, as one that runs an
    unguarded script's call of train does (the parent then reads a broken pipe)."""

    def start(self):
        raise BrokenPipeError(32, "Broken pipe")


@pytest.fixture
def no_cleaner(monkeypatch, tmp_path):
    """The stand-in jobs' files go to ``tmp_path``: no cleaner process starts for them."""
    monkeypatch.setattr("pipetrain.runtime.launch.caller_dir", lambda: tmp_path)


def test_a_worker_that_dies_while_started_names_the_unguarded_script_as_the_likely_cause(no_cleaner):
    ctx = type("Ctx", (), {"Process": _DiesWhileStarted})()
    with pytest.raises(PipetrainError, match=r"^rank 0 died while starting \(Broken pipe\); workers first import "
                                             r"your script .+: if it calls pipetrain.train outside"):
        _spawn_once(ctx, print, lambda rank: (), 1, 0, "rank {}".format, poll_s=0.01, silent_after=None, log_dir=None,
                    timeout=None)


def test_a_job_that_finishes_just_as_its_time_limit_passes_returns_its_results(no_cleaner):
    ctx = type("Ctx", (), {"Process": _ExitsWhenFirstSeen})()
    results = _spawn_once(ctx, print, lambda rank: (), 1, 0, "rank {}".format, poll_s=0.01, silent_after=None,
                          log_dir=None, timeout=0)
    assert results == [{"rank": 0}]


@pytest.mark.multiprocess
def test_a_worker_stuck_holding_the_gil_is_named_with_where_it_is_stuck(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(PipetrainError, match=r"^rank 1 went silent: no sign of life for [0-9]+s \(stopped, or stuck "
                       r"in code that holds the GIL\); the other workers were stopped \(Python stacks: ") as e:
        spawn(_wait_forever, 2, (1,), silent_after=2, log_dir=tmp_path)
    assert time.monotonic() - t0 < 30
    assert e.value.kind == "silent" and e.value.rank == 1
    stacks = dict(s.split("\n", 1) for s in e.value.log.read_text().split("== rank ")[1:])
    assert set(stacks) == {"0", "1"} and all("in _wait_forever" in s for s in stacks.values())

def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc's parent links)."""
    import os
    parent = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found.update(kids)
        todo += kids
    return found


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy,when", [("pipeline", "training"), ("pipe-sgd", "training"),
                                           ("pipeline", "starting")])
def test_killing_the_caller_leaves_no_process_behind(strategy, when, tmp_path):
    """SIGKILL the process that called train, while its workers train or as soon as it has made its
    temporary directory (before or between its first jobs): its workers, the fork server and its
    cleaner are gone within seconds, and so are its temporary directories."""
    import os
    import signal
    import subprocess
    import sys
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    layout = "stages=[0, 2, 4, 6]" if strategy == "pipeline" else "workers=2"
    code = ("import functools, torch, pipetrain, sys; sys.path.insert(0, 'tests'); from pt_models import mlp; "
            "from pipetrain.data import regression\n"
            "if __name__ == '__main__':\n"
            f"    pipetrain.train(mlp(), regression(4096, 4, 3), strategy={strategy!r}, {layout}, "
            "loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.01), "
            "batch_size=4, epochs=1000, timeout=60)\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 60
    if when == "starting":
        while not list(tmp.glob("pipetrain-*")) and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        while len(_descendants(proc.pid)) < 4 and time.monotonic() < deadline:  # fork server, workers
            time.sleep(0.2)
        time.sleep(1.0)  # training
    below = _descendants(proc.pid)
    assert below, "nothing started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") and _alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in below if os.path.exists(f"/proc/{p}") and _alive(p)]
    assert [p.name for p in tmp.iterdir() if p.name.startswith(("pipetrain-", "pymp-"))] == []  # torch's caches stay


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.multiprocess
def test_a_diverging_loss_stops_the_run_with_its_history(tmp_path):
    """Cross entropy on regression targets runs off to minus infinity: stopped as diverged, not a result."""
    with pytest.raises(pipetrain.PipetrainError, match=r"loss diverged: -1\.\d+e\+04 at epoch \d+ minibatch \d+, "
                                                       r"from 0\.\d+ at the start") as failed:
        pipetrain.train(mlp(), regression(256, 4, 3), loss_fn=torch.nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=30.0), stages=[0, 4], batch_size=16,
                        epochs=20, checkpoint_dir=tmp_path)
    assert failed.value.kind == "error" and len(failed.value.history) > 0
    assert abs(failed.value.history[-1]["loss"]) < 1e4  # the records before the diverged step


@pytest.mark.multiprocess
def test_resume_from_an_empty_directory_says_it_starts_from_scratch(tmp_path):
    with pytest.warns(pipetrain.PipetrainWarning, match="holds no complete checkpoint of this job; starting from "
                                                        "epoch 0"):
        result = train(checkpoint_dir=tmp_path / "new", resume=True)
    assert result.epochs_trained == 1


class Raises(nn.Module):
    def forward(self, x):
        raise ValueError("this layer is broken")


@pytest.mark.multiprocess
def test_an_error_in_a_stage_names_the_stage_and_keeps_the_traceback():
    with pytest.raises(pipetrain.PipetrainError, match=r"^StageError: stage 1 \(rank 1\): the forward of minibatch "
                                                       r"0 failed: ValueError: this layer is broken \(tracebacks: "
                                                       r"(.*\.log)\)$") as failed:
        train(model=with_fault(Raises()), stages=[0, 2, 5, 7])
    log = failed.value.log
    assert "in forward" in log.read_text() and 'raise ValueError("this layer is broken")' in log.read_text()
    log.unlink()


@pytest.mark.multiprocess
def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    """Workers first import the caller's script; one that calls train at its top level makes them start
    workers of their own, which multiprocessing refuses. The error says what to do."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text("import functools, torch, pipetrain\nfrom pipetrain.data import regression\n"
                      "net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))\n"
                      "pipetrain.train(net, regression(64, 4, 3), loss_fn=torch.nn.functional.mse_loss, "
                      "optimizer=functools.partial(torch.optim.SGD, lr=0.05), stages=[0, 2], batch_size=8)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert r.returncode != 0
    assert ("died with exit code 1 before it began its task; workers first import your script unguarded.py: "
            'if it calls pipetrain.train outside `if __name__ == "__main__":`, put the call under it') in r.stderr
