"""CGDP (``strategy="cgdp"``): synchronous SGD, so in float64 its weights equal plain minibatch SGD,
computed here by an ordinary PyTorch loop on the whole minibatch; and bitwise equal across chunk sizes,
since every element of the host sum is added in rank order whoever sums it."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from launching import ROOT, free_port, run_locally
from pipetrain.strategies import cgdp as cgdp_module
from pt_models import FaultAt, Residual

N_MB, BATCH, LR, EPOCHS = 12, 6, 0.1, 2


def model() -> nn.Sequential:
    """Four layers with parameters (3 hidden, 1 output), float64."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(),
                         nn.Linear(5, 3)).double()


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(17)
    return TensorDataset(torch.randn(N_MB * BATCH, 4, generator=g, dtype=torch.float64),
                         torch.randn(N_MB * BATCH, 3, generator=g, dtype=torch.float64))


def reference(net: nn.Module, epochs: int = EPOCHS) -> list[torch.Tensor]:
    """Plain minibatch SGD on the whole minibatch: the mean of equal shards' mean gradients."""
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = dataset().tensors
    for _ in range(epochs):
        for t in range(N_MB):
            opt.zero_grad()
            nn.functional.mse_loss(net(x[t * BATCH:(t + 1) * BATCH]), y[t * BATCH:(t + 1) * BATCH]).backward()
            opt.step()
    return [p.detach() for p in net.parameters()]


def train(net: nn.Module | None = None, chunk: int | str = "auto", **kw) -> pipetrain.TrainResult:
    args = dict(loss_fn=nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                strategy=pipetrain.CGDP(chunk=chunk), workers=2, batch_size=BATCH, epochs=EPOCHS, shuffle=False, timeout=60)
    return pipetrain.train(net if net is not None else model(), dataset(), **{**args, **kw})


def weights(result: pipetrain.TrainResult) -> list[torch.Tensor]:
    return [p.detach() for p in result.model.parameters()]


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [2, 3])
def test_equals_minibatch_sgd_and_is_bitwise_the_same_for_every_chunk_size(workers: int) -> None:
    want = reference(model())
    runs = {chunk: train(workers=workers, chunk=chunk) for chunk in (1, 2, 3, 100, "auto")}
    for chunk, result in runs.items():
        for got, ref in zip(weights(result), want):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-9, msg=f"chunk {chunk}")
        assert [h["step"] for h in result.history] == list(range(1, EPOCHS * N_MB + 1))
    for chunk, result in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(weights(result), weights(runs[1]))), f"chunk {chunk}"
    # the run-time search moved the chunk size during the run (judged every 10 iterations)
    chunks = runs["auto"].sync_stats[0]["chunks"]
    assert chunks[:11] == [1] * 11 and chunks[11:21] == [2] * 10 and len(chunks) == EPOCHS * N_MB
    assert runs[2].sync_stats[0]["chunks"] == [2] * (EPOCHS * N_MB)


@pytest.mark.multiprocess
def test_the_loss_recorded_is_the_minibatch_mean() -> None:
    result = train(epochs=1)
    x, y = dataset().tensors
    with torch.no_grad():
        want = nn.functional.mse_loss(model()(x[:BATCH]), y[:BATCH]).item()
    assert result.history[0]["loss"] == pytest.approx(want, rel=1e-12)


class Unused(nn.Module):
    """fx cannot trace it (data-dependent branch), and one of its parameters gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a, self.b, self.spare = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) if x.shape[0] > 0 else self.spare(self.b(h))


@pytest.mark.multiprocess
@pytest.mark.parametrize("make", [lambda: Residual().double(), lambda: Unused().double()],
                         ids=["fx-residual", "untraceable-with-an-unused-layer"])
def test_models_that_are_not_sequential(make) -> None:
    result = train(make(), chunk=1)
    for got, ref in zip(weights(result), reference(make())):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


@pytest.mark.multiprocess
def test_resume_continues_exactly(tmp_path) -> None:
    train(epochs=1, chunk=2, checkpoint_dir=tmp_path)
    resumed = train(chunk=2, checkpoint_dir=tmp_path, resume=True)
    for got, ref in zip(weights(resumed), reference(model())):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


@pytest.mark.multiprocess
def test_several_machines_sum_hierarchically(tmp_path) -> None:
    """Two torchrun nodes of 2 workers each on this machine: each node sums in its own host memory,
    then the nodes add their sums; the result equals a 4-worker run on one machine."""
    port = free_port()
    env = {**os.environ, "PIPETRAIN_EXAMPLE_OUT": str(tmp_path / "nodes.pt")}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(n), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                               str(port), "examples/mlp_job.py", "--strategy", "cgdp"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    try:
        errs = [p.communicate(timeout=300)[1] for p in nodes]
    except subprocess.TimeoutExpired:
        for p in nodes:
            p.kill()
        errs = [p.communicate()[1] for p in nodes]
    # a worker's own error comes before torchrun's summary of the failure: show both, of every node
    # (one that finished too: a node left waiting may be waiting on it)
    said = "\n".join(f"node {n} (exit {p.returncode}):\n{err[:4000]}\n...\n{err[-1500:]}"
                     for n, (p, err) in enumerate(zip(nodes, errs)))
    assert all(p.returncode == 0 for p in nodes), said
    a = torch.load(tmp_path / "nodes.pt", weights_only=True)
    b = run_locally("cgdp", tmp_path / "one.pt", 4)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-9)


@pytest.mark.multiprocess
def test_a_dead_worker_is_named_and_nothing_hangs() -> None:
    t0 = time.monotonic()
    with pytest.raises(pipetrain.PipetrainError, match="worker 1 died with exit code 3"):
        train(nn.Sequential(FaultAt(3, "die", rank=1), *model()), timeout=10)
    assert time.monotonic() - t0 < 30


@pytest.mark.multiprocess
def test_no_shared_memory_file_is_left_behind() -> None:
    before = set(cgdp_module.HOST_MEMORY.glob("pipetrain-cgdp-*"))
    train(epochs=1)
    assert set(cgdp_module.HOST_MEMORY.glob("pipetrain-cgdp-*")) == before


@pytest.mark.parametrize("call,message", [
    (lambda: pipetrain.CGDP(chunk=0), "chunk=0: give the layers per chunk (an integer >= 1) or 'auto'"),
    (lambda: pipetrain.CGDP(chunk="best"), "chunk='best': give the layers per chunk"),
    (lambda: pipetrain.registry.make("strategy", "ddp", {"chunk": 2}), "chunk applies to strategy 'cgdp', not 'ddp'"),
    (lambda: train(workers=4), "batch_size 6 does not split into 4 equal shards"),
])
def test_bad_arguments_are_one_line_errors(call, message: str) -> None:
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_too_little_shared_memory_is_said_before_any_worker_starts(monkeypatch) -> None:
    class Tiny:
        f_bavail, f_frsize = 0, 4096
    monkeypatch.setattr(os, "statvfs", lambda path: Tiny())
    with pytest.raises(ValueError, match=r"cgdp needs 0 MiB of shared memory in /dev/shm .* --shm-size"):
        train()


def test_the_chunk_search_hears_every_iteration_when_the_last_chunk_comes_back_in_a_hook(monkeypatch) -> None:
    """The summing thread may finish the iteration's last chunk before the backward's last hook looks:
    the chunk then comes back in the hook, not at ``S``, and the slowest worker's time it carries must
    still reach the search (lost, the workers would fall out of step on the chunk size and hang). Forced
    here by making every hook wait for the sums it looks at."""
    import torch.distributed as dist
    from pipetrain.layout import Layout
    from pipetrain.strategies.base import SyncContext

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        net = model()
        sync = cgdp_module.cgdp(SyncContext(rank=0, layout=Layout.data_parallel_on(1), device=torch.device("cpu"), timeout=20), "auto")
        sync.wrap(net)
        real_ready = sync._done.ready

        def ready_once_summed(key) -> bool:
            deadline = time.monotonic() + 10
            while not real_ready(key) and time.monotonic() < deadline:
                time.sleep(0.001)
            return real_ready(key)

        monkeypatch.setattr(sync._done, "ready", ready_once_summed)
        x, y = dataset().tensors
        iterations = 25
        for t in range(iterations):
            weights = dict(net.named_parameters())
            sync.watch(weights)
            nn.functional.mse_loss(net(x[:BATCH]), y[:BATCH]).backward()
            sync.start(t, weights)
            sync.wait(t, weights)
        sync.close()
        # the first iteration has no time yet (it started nothing before it), every later one is heard
        assert sync.search.iterations == iterations - 1
        assert sync.chunks[:11] == [1] * 11 and sync.chunks[11:21] == [2] * 10
    finally:
        dist.destroy_process_group()
