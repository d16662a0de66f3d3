"""Peer runners (DDP, torch.distributed.pipelining, PS-Sync) for a few steps with gloo processes on loopback."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from pipetrain.bench.measure import PeerConfig, summarize
from pipetrain.bench.torch_peers import ddp, no_sync, ps_sync, torch_pipeline
from pipetrain.runtime import launch
from pipetrain.errors import PipetrainError

pytestmark = pytest.mark.multiprocess

# mnist-mlp at 784-16-16-10: 13,002 parameters. Layers: Flatten, Linear, ReLU, Linear, ReLU, Linear.
TINY = PeerConfig(model="mnist-mlp", model_kwargs={"hidden": (16, 16)}, batch_size=16, warmup=1, windows=2,
                  steps_per_window=2, timeout_s=60)
# A job stuck where gloo's timeout does not reach fails with its workers' stacks, not at pytest's limit.
spawn = functools.partial(launch.spawn, timeout=3 * TINY.timeout_s)
PARAMS = 784 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10


def check_sane(results: list[dict], cfg: PeerConfig, world: int = 2) -> None:
    assert len(results) == world
    for r in results:
        assert len(r["window_samples_per_s"]) == cfg.windows
        assert all(0 < s < 1e7 for s in r["window_samples_per_s"])
        assert min(r["window_samples_per_s"]) <= r["samples_per_s"] <= max(r["window_samples_per_s"])
        assert r["iface_bytes_per_sample"] is None  # loopback: no per-worker interface
        assert r["update_norm"] > 0, f"rank {r['rank']} never learned"
    assert summarize(results)["samples_per_s"] == results[0]["samples_per_s"]


@pytest.mark.parametrize("fp16", [False, True])
def test_ddp(fp16: bool) -> None:
    results = spawn(ddp, 2, (TINY, fp16))
    check_sane(results, TINY)
    # Ring allreduce over 2 workers: each sends the gradient once (2 (M-1)/M = 1) per 16-sample step.
    expected = PARAMS * (2 if fp16 else 4) / TINY.batch_size
    assert [r["counted_bytes_per_sample"] for r in results] == [expected, expected]
    assert all(math.isfinite(r["loss"]) for r in results)
    assert results[0]["runner"] == ("ddp-fp16" if fp16 else "ddp")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_torch_pipeline(schedule: str) -> None:
    results = spawn(torch_pipeline, 2, (TINY, [0, 3], 4, schedule))
    check_sane(results, TINY)
    # The cut after the first ReLU carries 16 floats a sample: forward from rank 0, its gradient back from 1.
    assert [r["counted_bytes_per_sample"] for r in results] == [64.0, 64.0]
    assert results[0]["loss"] is None and math.isfinite(results[1]["loss"])
    assert [r["params"] for r in results] == [784 * 16 + 16, PARAMS - (784 * 16 + 16)]
    assert results[0]["runner"] == f"torch-{schedule}"


def test_torch_looped_schedules_hold_stages_rank_rank_plus_world() -> None:
    """Stages [0, 2, 3, 5] of Flatten, Linear, ReLU, Linear, ReLU, Linear on 2 ranks: rank 0 holds stages
    0 and 2, rank 1 stages 1 and 3; every cut carries 16 floats a sample."""
    results = spawn(torch_pipeline, 2, (TINY, [0, 2, 3, 5], 4, "interleaved-1f1b"))
    check_sane(results, TINY)
    # rank 0 sends 2 activations forward and 1 gradient back; rank 1 one forward and 2 back
    assert [r["counted_bytes_per_sample"] for r in results] == [192.0, 192.0]
    assert [r["params"] for r in results] == [784 * 16 + 16 + 16 * 16 + 16, 16 * 10 + 10]
    assert results[0]["loss"] is None and math.isfinite(results[1]["loss"])
    zero = spawn(torch_pipeline, 2, (TINY, [0, 3], 4, "zero-bubble"))
    check_sane(zero, TINY)
    assert [r["counted_bytes_per_sample"] for r in zero] == [64.0, 64.0] and zero[0]["runner"] == "torch-zero-bubble"


def test_torch_pipeline_cuts_an_fx_model_inside_a_residual_block() -> None:
    """resnet-like is not a Sequential; a cut inside a block sends the branch and the shortcut (a tuple)."""
    cfg = PeerConfig(model="resnet-like", model_kwargs={"width": 4, "blocks": (1, 1)}, batch_size=8, warmup=1,
                     windows=1, steps_per_window=1, timeout_s=60)
    results = spawn(torch_pipeline, 2, (cfg, [0, 5], 2, "1f1b"))
    # After stem (3 layers) and conv1, bn1: relu's input and the block input (the shortcut) cross: 2 x 4x32x32.
    assert results[0]["counted_bytes_per_sample"] == 2 * 4 * 32 * 32 * 4
    assert all(r["update_norm"] > 0 for r in results)


def sgd_on_the_concatenated_shards(cfg: PeerConfig, workers: int, shards: list[int]) -> torch.Tensor:
    """Plain minibatch SGD, written here from the definition: each step's minibatch is the workers'
    shards of that step side by side (worker w's shard i is samples [i*n, (i+1)*n) of its dataset,
    seeded cfg.seed + 1 + w, as ddp draws them); only the shards listed in ``shards`` are used."""
    n = cfg.batch_size // workers
    data = [cfg.spec.dataset(4 * n, seed=cfg.seed + 1 + w)[:] for w in range(workers)]
    model = cfg.build()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for i in range(cfg.warmup + cfg.windows * cfg.steps_per_window):
        rows = slice((i % 4) * n, (i % 4 + 1) * n)
        x = torch.cat([data[w][0][rows] for w in shards])
        y = torch.cat([data[w][1][rows] for w in shards])
        opt.zero_grad()
        cfg.spec.loss_fn(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_ps_sync_is_minibatch_sgd() -> None:
    """2 workers + a parameter server (rank 2) train exactly as one worker on the 16-sample minibatches."""
    results = spawn(ps_sync, 3, (TINY, True))
    check_sane(results, TINY, world=3)
    assert [r["role"] for r in results] == ["worker", "worker", "server"]
    assert results[0]["runner"] == "ps-sync"
    assert all(math.isfinite(r["loss"]) for r in results[:2]) and results[2]["loss"] is None
    # A worker sends its gradient once per 16-sample step; the server sends the weights to both workers.
    grad = PARAMS * 4 / TINY.batch_size
    assert [r["counted_bytes_per_sample"] for r in results] == [grad, grad, 2 * grad]
    expected = sgd_on_the_concatenated_shards(TINY, 2, [0, 1])
    for r in results:  # the server's weights and each worker's model
        torch.testing.assert_close(r["weights"], expected, rtol=0, atol=1e-6)
    # guard: the comparison can tell the rules apart (SGD on worker 0's shard alone lands elsewhere)
    alone = sgd_on_the_concatenated_shards(TINY, 2, [0])
    assert (alone - expected).abs().max() > 100 * 1e-6


def test_no_sync_trains_each_shard_alone() -> None:
    results = spawn(no_sync, 2, (TINY,))
    check_sane(results, TINY)
    assert [r["counted_bytes_per_sample"] for r in results] == [0.0, 0.0]
    assert results[0]["runner"] == "no-sync"


def test_bad_arguments_fail_with_one_line() -> None:
    with pytest.raises(ValueError, match="not in the zoo"):
        PeerConfig(model="gpt-5")
    with pytest.raises(PipetrainError, match=r"1f1b needs microbatches >= ranks \(2\)"):
        spawn(torch_pipeline, 2, (TINY, [0, 3], 1, "1f1b"))
    with pytest.raises(PipetrainError, match="3 stages do not loop evenly over 2 ranks"):
        spawn(torch_pipeline, 2, (TINY, [0, 2, 3], 4, "interleaved-1f1b"))
    with pytest.raises(PipetrainError, match="batch_size=16 must be divisible by the 3 ps-sync workers"):
        spawn(ps_sync, 4, (TINY,))
