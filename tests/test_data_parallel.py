"""Data-parallel strategies (ddp, pipe-sgd): the exact update rule in float64 against an independent
reference, compression, checkpoints and resume, and the one-line errors.

Pipe-SGD's rule (Alg. 1, §3.1), as the reference below computes it with plain tensors: within an epoch
that starts at weights W[0], minibatch m (0-based) takes its gradient at W[max(0, m - K + 1)], the mean
of the workers' gradients on their equal consecutive shards, and W[j] = W[j-1] - lr * gradient of
minibatch j-1. K = 1 (and every warm-up epoch) is plain minibatch SGD. Each epoch drains.
"""
from __future__ import annotations

import functools
import time

import pytest
import torch
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.registry import make
from pipetrain.runtime import checkpoint
from pt_models import FaultAt

N_MB, BATCH, LR, EPOCHS = 8, 6, 0.1, 2
SIZES = (4, 5, 3)


def model(dtype: torch.dtype = torch.float64, hidden: int = SIZES[1]) -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(SIZES[0], hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, SIZES[2])).to(dtype)


def dataset(dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(N_MB * BATCH, SIZES[0], generator=g, dtype=dtype),
                         torch.randn(N_MB * BATCH, SIZES[2], generator=g, dtype=dtype))


def reference(workers: int, staleness: int, warmup_epochs: int) -> list[torch.Tensor]:
    """Plain-tensor Pipe-SGD: weights kept per version, shard gradients averaged by hand."""
    w1, b1, w2, b2 = (p.detach().clone() for p in model().parameters())
    x_all, y_all = dataset().tensors
    shard = BATCH // workers
    for epoch in range(EPOCHS):
        k = 1 if epoch < warmup_epochs else staleness
        versions = [(w1, b1, w2, b2)]
        for m in range(N_MB):
            used = [p.clone().requires_grad_() for p in versions[max(0, m - k + 1)]]
            total = [torch.zeros_like(p) for p in used]
            for i in range(workers):
                lo = m * BATCH + i * shard
                x, y = x_all[lo:lo + shard], y_all[lo:lo + shard]
                out = torch.tanh(x @ used[0].T + used[1]) @ used[2].T + used[3]
                for t, g in zip(total, torch.autograd.grad(((out - y) ** 2).mean(), used)):
                    t += g
            versions.append(tuple(p - LR * g / workers for p, g in zip(versions[-1], total)))
        w1, b1, w2, b2 = versions[-1]
    return [w1, b1, w2, b2]


def train(strategy: str | pipetrain.registry.Strategy = "pipe-sgd", **kw) -> pipetrain.TrainResult:
    net, data = kw.pop("net", None) or model(), kw.pop("data", None) or dataset()
    args = dict(loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                strategy=strategy, workers=2, batch_size=BATCH, epochs=EPOCHS, shuffle=False, timeout=60)
    return pipetrain.train(net, data, **{**args, **kw})


def assert_same(result: pipetrain.TrainResult, want: list[torch.Tensor], tol: float = 1e-9) -> None:
    for got, ref in zip(result.model.parameters(), want):
        torch.testing.assert_close(got.detach(), ref, rtol=0, atol=tol)


@pytest.mark.multiprocess
@pytest.mark.parametrize("warmup_epochs", [0, 1])
@pytest.mark.parametrize("staleness", [1, 2, 3])
@pytest.mark.parametrize("workers", [2, 3])
def test_pipe_sgd_is_exact(workers: int, staleness: int, warmup_epochs: int) -> None:
    result = train(pipetrain.PipeSGD(staleness=staleness, warmup_epochs=warmup_epochs), workers=workers)
    assert_same(result, reference(workers, staleness, warmup_epochs))
    # one record per update, the loss of the whole minibatch
    assert [h["step"] for h in result.history] == list(range(1, EPOCHS * N_MB + 1))
    assert all(h["samples"] == BATCH for h in result.history)


def test_the_staleness_rules_really_differ() -> None:
    """Guards the test above: K and the warm-up change the result."""
    refs = [reference(2, 1, 0), reference(2, 2, 0), reference(2, 3, 0), reference(2, 2, 1)]
    for i in range(len(refs)):
        for j in range(i + 1, len(refs)):
            assert (refs[i][0] - refs[j][0]).abs().max() > 1e-6


@pytest.mark.multiprocess
def test_ddp_is_plain_minibatch_sgd() -> None:
    result = train("ddp")
    assert_same(result, reference(2, 1, 0))
    # DDP's allreduce over 2 workers: each sends half... twice: 2 (M-1)/M of the gradient per minibatch
    grad_bytes = sum(p.numel() * 8 for p in model().parameters())
    assert result.bytes_sent == [grad_bytes * EPOCHS * N_MB] * 2


@pytest.mark.multiprocess
def test_loss_in_history_is_the_minibatch_mean() -> None:
    """The loss recorded for update 1 (before any update) is the full minibatch's loss at W[0]."""
    result = train(pipetrain.PipeSGD(staleness=2))
    x, y = dataset().tensors
    with torch.no_grad():
        want = torch.nn.functional.mse_loss(model()(x[:BATCH]), y[:BATCH]).item()
    assert result.history[0]["loss"] == pytest.approx(want, rel=1e-12)


@pytest.mark.multiprocess
def test_adam_counts_real_updates_only(tmp_path) -> None:
    """No zero gradient is ever applied: Adam's step count equals the minibatches trained."""
    train(pipetrain.PipeSGD(staleness=3), optimizer=functools.partial(torch.optim.Adam, lr=1e-3), checkpoint_dir=tmp_path)
    for rank in range(2):
        state = torch.load(checkpoint.path(tmp_path, rank, EPOCHS - 1), weights_only=True)
        assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {EPOCHS * N_MB}


@pytest.mark.multiprocess
def test_resume_continues_exactly(tmp_path) -> None:
    """A run stopped after epoch 0 and resumed ends where an uninterrupted run does."""
    train(pipetrain.PipeSGD(staleness=2), epochs=1, checkpoint_dir=tmp_path)
    resumed = train(pipetrain.PipeSGD(staleness=2), checkpoint_dir=tmp_path, resume=True)
    assert [h["step"] for h in resumed.history] == list(range(1, EPOCHS * N_MB + 1))  # whole: epoch 0 from the checkpoint
    assert_same(resumed, reference(2, 2, 0))
    with pytest.warns(pipetrain.PipetrainWarning, match="nothing left to train"):  # another strategy reads it
        again = train("ddp", checkpoint_dir=tmp_path, resume=True)
    assert_same(again, reference(2, 2, 0))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [pipetrain.DDP(), pipetrain.PipeSGD(staleness=2), pipetrain.CGDP(chunk=1)],
                         ids=["ddp", "pipe-sgd", "cgdp"])
def test_one_worker_keeps_the_update_rule_and_sends_nothing(strategy: pipetrain.registry.Strategy) -> None:
    """One worker has nothing to agree on, yet trains by its strategy's rule (Pipe-SGD: stale by K-1)."""
    result = train(strategy, workers=1)
    assert_same(result, reference(1, strategy.staleness_at(0), 0))
    assert result.bytes_sent == [0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("codec", ["trunc16", "quant8"])
def test_compressed_ring_trains_and_really_compresses(codec: str) -> None:
    """float32 with a codec: workers end identical (checked by train), the loss falls, the weights
    differ from the uncompressed run, and fewer bytes cross than without compression."""
    sgd = functools.partial(torch.optim.SGD, lr=0.01)
    plain = train(net=model(torch.float32, 512), data=dataset(torch.float32), epochs=3, optimizer=sgd)
    packed = train(pipetrain.PipeSGD(compression=codec), net=model(torch.float32, 512), data=dataset(torch.float32),
                   epochs=3, optimizer=sgd)
    losses = [h["loss"] for h in packed.history]
    assert sum(losses[-N_MB:]) < sum(losses[:N_MB])
    assert any((a - b).abs().max() > 0 for a, b in zip(plain.model.parameters(), packed.model.parameters()))
    # 4,099 parameters, 2 workers: float32 blocks of 2,050; trunc16 halves them, quant8 pads to 3,072 one-byte values
    assert packed.bytes_sent[0] < (0.6 if codec == "trunc16" else 0.4) * plain.bytes_sent[0]
    assert len(packed.sync_stats[0]["ring_seconds"]) == 3 * N_MB


BAD = [
    (lambda: train("horovod"), "unknown strategy 'horovod'; choose one of auto, pipeline, ddp, pipe-sgd"),
    (lambda: pipetrain.PipeSGD(compression="zip"), "unknown codec 'zip'"),
    (lambda: pipetrain.PipeSGD(staleness=0), "staleness=0 must be an integer >= 1"),
    (lambda: pipetrain.PipeSGD(warmup_epochs=-1), "warmup_epochs=-1 must be an integer >= 0"),
    (lambda: train(pipetrain.PipeSGD(compression="quant8")),
     "works on float32 gradients, but the model's parameters are torch.float64"),
    (lambda: train(stages=[0, 2]), "stages applies to strategy 'pipeline', not 'pipe-sgd'"),
    (lambda: train(schedule="gpipe"), "schedule applies to strategy 'pipeline'"),
    (lambda: train(schedule=pipetrain.GPipe(microbatches=2)), "schedule applies to strategy 'pipeline'"),
    (lambda: train("pipeline", workers=None), "strategy='pipeline' needs stages"),
    (lambda: train(workers=4), "batch_size 6 does not split into 4 equal shards"),
    (lambda: train(workers=None), "strategy='pipe-sgd' needs workers=N"),
    # the CLI's flags name options by themselves: one given to the wrong strategy is refused
    (lambda: make("strategy", "ddp", {"staleness": 2}), "staleness applies to strategy 'pipe-sgd', not 'ddp'"),
    (lambda: make("strategy", "ddp", {"compression": "trunc16"}), "compression applies to strategy 'pipe-sgd', not "
                                                                  "'ddp'"),
    (lambda: make("strategy", "pipeline", {"staleness": 2}), "staleness applies to strategy 'pipe-sgd'"),
]


@pytest.mark.parametrize("call,message", BAD, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_arguments_are_one_line_errors(call, message: str) -> None:
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)


def faulty(how: str) -> torch.nn.Sequential:
    """The exactness model with a layer that fails on worker 1's 3rd forward."""
    return torch.nn.Sequential(FaultAt(3, how, rank=1), *model())


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["pipe-sgd", "ddp"])
def test_a_dead_worker_is_named_and_nothing_hangs(strategy: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(pipetrain.PipetrainError, match="worker 1 died with exit code 3"):
        train(strategy, net=faulty("die"), timeout=10)
    assert time.monotonic() - t0 < 30


@pytest.mark.multiprocess
def test_a_silent_worker_fails_the_sync_within_the_timeout() -> None:
    t0 = time.monotonic()
    # The mailbox's own 3 s deadline, or gloo's 3 s on the communication thread's send: whichever fires first.
    with pytest.raises(pipetrain.PipetrainError, match=r"minibatch \d+ (did not finish within 3s|failed \(.*Timed out "
                                                       r"waiting 3000ms.*\)): a worker died or went silent"):
        train(net=faulty("hang"), timeout=3)
    assert time.monotonic() - t0 < 30


def bn_model() -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.BatchNorm1d(SIZES[1]), torch.nn.Tanh(),
                               torch.nn.Linear(SIZES[1], SIZES[2])).double()


def bn_reference(workers: int) -> dict[str, torch.Tensor]:
    """Synchronous SGD on a BatchNorm model, by hand: every worker normalizes its own shard with that
    shard's statistics and keeps its own running statistics; the weights take the mean gradient; at each
    epoch's end the running statistics become the workers' mean."""
    (w1, b1, gamma, beta, w2, b2) = (p.detach().clone() for p in bn_model().parameters())
    mean = [torch.zeros(SIZES[1], dtype=torch.float64) for _ in range(workers)]
    var = [torch.ones(SIZES[1], dtype=torch.float64) for _ in range(workers)]
    x_all, y_all = dataset().tensors
    shard, momentum = BATCH // workers, 0.1
    for _ in range(EPOCHS):
        for m in range(N_MB):
            params = [p.clone().requires_grad_() for p in (w1, b1, gamma, beta, w2, b2)]
            total = [torch.zeros_like(p) for p in params]
            for i in range(workers):
                lo = m * BATCH + i * shard
                x, y = x_all[lo:lo + shard], y_all[lo:lo + shard]
                h = x @ params[0].T + params[1]
                mu, v = h.mean(0), h.var(0, unbiased=False)
                out = torch.tanh((h - mu) / torch.sqrt(v + 1e-5) * params[2] + params[3]) @ params[4].T + params[5]
                for t, g in zip(total, torch.autograd.grad(((out - y) ** 2).mean(), params)):
                    t += g
                with torch.no_grad():
                    mean[i] = (1 - momentum) * mean[i] + momentum * mu
                    var[i] = (1 - momentum) * var[i] + momentum * h.var(0, unbiased=True)
            w1, b1, gamma, beta, w2, b2 = (p.detach() - LR * g / workers for p, g in zip(params, total))
        mean = [sum(mean) / workers] * workers
        var = [sum(var) / workers] * workers
    return {"0.weight": w1, "0.bias": b1, "1.weight": gamma, "1.bias": beta, "1.running_mean": mean[0],
            "1.running_var": var[0], "3.weight": w2, "3.bias": b2}


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [pipetrain.DDP(), pipetrain.CGDP(chunk=1), pipetrain.PipeSGD(staleness=1)])
def test_batchnorm_statistics_are_the_workers_mean_after_each_epoch(strategy) -> None:
    """Workers' running statistics drift apart (each sees its own shard); they are averaged at every
    epoch's end, so the workers end identical (as the end-of-run check requires) and exact."""
    state = train(strategy, net=bn_model()).model.state_dict()
    for key, want in bn_reference(2).items():
        torch.testing.assert_close(state[key], want, rtol=0, atol=1e-9, msg=key)
