"""Peer runners (DDP, torch.distributed.pipelining) for a few steps with 2 gloo processes on loopback."""
from __future__ import annotations

import math

import pytest

from pipetrain.bench.peers import PeerConfig, ddp, summarize, torch_pipeline
from pipetrain.runtime.launch import PipetrainError, spawn

# mnist-mlp at 784-16-16-10: 13,002 parameters. Layers: Flatten, Linear, ReLU, Linear, ReLU, Linear.
TINY = PeerConfig(model="mnist-mlp", model_kwargs={"hidden": (16, 16)}, batch_size=16, warmup=1, windows=2,
                  steps_per_window=2, timeout_s=60)
PARAMS = 784 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10


def check_sane(results: list[dict], cfg: PeerConfig) -> None:
    assert len(results) == 2
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


def test_torch_pipeline_cuts_an_fx_model_inside_a_residual_block() -> None:
    """resnet-like is not a Sequential; a cut inside a block sends the branch and the shortcut (a tuple)."""
    cfg = PeerConfig(model="resnet-like", model_kwargs={"width": 4, "blocks": (1, 1)}, batch_size=8, warmup=1,
                     windows=1, steps_per_window=1, timeout_s=60)
    results = spawn(torch_pipeline, 2, (cfg, [0, 5], 2, "1f1b"))
    # After stem (3 layers) and conv1, bn1: relu's input and the block input (the shortcut) cross: 2 x 4x32x32.
    assert results[0]["counted_bytes_per_sample"] == 2 * 4 * 32 * 32 * 4
    assert all(r["update_norm"] > 0 for r in results)


def test_bad_arguments_fail_with_one_line() -> None:
    with pytest.raises(ValueError, match="not in the zoo"):
        PeerConfig(model="gpt-5")
    with pytest.raises(PipetrainError, match="microbatches >= stages"):
        spawn(torch_pipeline, 2, (TINY, [0, 3], 1, "1f1b"))
