"""The CUDA paths on a real GPU: skipped where there is none.

Several workers share the one GPU over gloo (NCCL refuses two ranks on one GPU), so these also check
that gloo's host staging moves a GPU's tensors. Each job runs as a script (tests/gpu/job.py) twice
where it is compared: with the GPU, and with it hidden (``CUDA_VISIBLE_DEVICES=""``), the same job on
the CPU. Float64 where exactness is checked.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipetrain.layers import LayeredModel
from pipetrain.profiling import profile_model
from pipetrain.runtime.launch import spawn
from pipetrain.strategies.compression import get_codec
from pipetrain.strategies.ring import block_size, ring_allreduce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("job.py")


def job(tmp_path: Path, name: str, options: dict, cpu: bool = False) -> dict:
    """tests/gpu/job.py with ``options``, on the GPU or (``cpu``) with it hidden; what it saved."""
    out = tmp_path / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, str(JOB), str(out), json.dumps(options)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = torch.load(out, weights_only=False)
    assert saved["gpu"] is not cpu
    return saved


def assert_close(a: dict, b: dict, tol: float = 1e-9) -> None:
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=tol, msg=key)


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", [{"stages": [0, 4]}, {"stages": [0, 4], "schedule": "1f1b-flush", "microbatches": 2},
                                 {"stages": [0, 4], "schedule": "zero-bubble", "microbatches": 2},
                                 {"stages": [0, 2], "model": "shape-branch"}, {"stages": [0, 3], "model": "tied"}],
                         ids=["pipedream", "1f1b-flush", "zero-bubble", "exported model", "tied weights"])
def test_two_stages_sharing_one_gpu_equal_the_same_job_on_the_cpu(tmp_path, how) -> None:
    options = {"backend": "gloo", **how}
    gpu = job(tmp_path, "gpu", options)
    cpu = job(tmp_path, "cpu", options, cpu=True)
    assert_close(gpu["state"], cpu["state"])
    assert [h["loss"] for h in gpu["history"]] == pytest.approx([h["loss"] for h in cpu["history"]], abs=1e-9)


@pytest.mark.multiprocess
def test_a_meta_model_loads_its_stages_from_safetensors_onto_the_gpu(tmp_path) -> None:
    """Each worker reads its stage from the file straight onto its device; the same job on the CPU gives
    the same weights."""
    sys.path.insert(0, str(JOB.parent))
    from job import write_weights
    write_weights(str(tmp_path / "weights.safetensors"))
    options = {"backend": "gloo", "stages": [0, 2, 4], "schedule": "1f1b-flush", "microbatches": 2,
               "weights": str(tmp_path / "weights.safetensors")}
    gpu = job(tmp_path, "gpu", dict(options))
    cpu = job(tmp_path, "cpu", dict(options), cpu=True)
    assert sorted(gpu["state"]) == sorted(cpu["state"])
    assert_close(gpu["state"], cpu["state"])


@pytest.mark.multiprocess
def test_each_worker_sharing_the_gpu_holds_its_stage_not_the_model(tmp_path) -> None:
    """Two stages of 12.6 MiB each: a worker's device peak is its stage's weights, their gradients and a
    little activation memory, below what the whole model's weights and one stage's gradients would take;
    the prediction (no baseline on a GPU) is within 30% of it."""
    sys.path.insert(0, str(JOB.parent))
    from job import wide
    model = wide()
    stage = [sum(p.numel() * 4 for m in list(model)[a:b] for p in m.parameters()) for a, b in ((0, 8), (8, 15))]
    whole = sum(stage)
    done = job(tmp_path, "gpu", {"backend": "gloo", "stages": [0, 8], "model": "wide", "schedule": "1f1b-flush",
                                 "microbatches": 2})
    for mine, peak, predicted in zip(stage, done["peak_device_memory"], done["predicted_memory"]):
        assert 2 * mine <= peak < whole + mine, (stage, done["peak_device_memory"])
        assert abs(predicted / peak - 1) < 0.3, (done["predicted_memory"], done["peak_device_memory"])


@pytest.mark.multiprocess
def test_nccl_with_two_workers_on_one_gpu_is_refused_before_any_worker_starts(tmp_path) -> None:
    if torch.cuda.device_count() != 1:
        pytest.skip("needs a machine with exactly one GPU")
    done = subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", "examples.mlp_job:model", "--data",
                           "examples.mlp_job:data", "--loss", "mse_loss", "--stages", "0,4", "--backend", "nccl"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "pipetrain train: error: backend='nccl' needs a GPU per worker, but 2 workers on this machine would share 1 GPU")


@pytest.mark.multiprocess
def test_cgdp_on_one_gpu_matches_the_cpu_and_every_chunk_size_bitwise(tmp_path) -> None:
    """Two workers on one GPU: gradients copied to pinned shared host memory on their own streams,
    summed there, copied back. Every chunk size gives the same bits; the run equals the CPU's."""
    runs = {chunk: job(tmp_path, f"cgdp{chunk}", {"strategy": "cgdp", "workers": 2, "chunk": chunk, "epochs": 2})
            for chunk in (1, 3, "auto")}
    for chunk, run in runs.items():
        assert all(torch.equal(run["state"][k], runs[1]["state"][k]) for k in run["state"]), f"chunk {chunk}"
    search = runs["auto"]["sync_stats"][0]["search"]
    assert search is not None and search["trials"], search  # the run-time chunk search ran
    cpu = job(tmp_path, "cgdp-cpu", {"strategy": "cgdp", "workers": 2, "chunk": 1, "epochs": 2}, cpu=True)
    assert_close(runs[1]["state"], cpu["state"])


def _rings() -> dict:
    """Every codec's ring on the same blocks, on the CPU and on this rank's GPU (over gloo: staged)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in ("none", "trunc16", "quant8"):
        codec = get_codec(None if name == "none" else name)
        b = block_size(5000, world, codec.granule)
        g = torch.Generator().manual_seed(100 + rank)
        blocks = torch.randn(world * b, generator=g).mul_(torch.randn(world * b, generator=g).exp()).view(world, b)
        on_cpu, on_gpu = blocks.clone(), blocks.cuda()
        ring_allreduce(on_cpu, None, codec)
        ring_allreduce(on_gpu, None, codec)
        out[name] = (on_cpu, on_gpu.cpu())
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_the_ring_on_gpu_tensors_is_bitwise_the_ring_on_the_cpu() -> None:
    for rank_result in spawn(_rings, 2, ()):
        for name, (on_cpu, on_gpu) in rank_result.items():
            assert torch.equal(on_cpu, on_gpu), name


@pytest.mark.multiprocess
def test_pipe_sgds_allreduce_of_t_runs_during_the_compute_of_t_plus_1(tmp_path) -> None:
    """K = 2: the communication thread's ring of minibatch t overlaps the forward or backward of t+1."""
    run = job(tmp_path, "pipe-sgd", {"strategy": "pipe-sgd", "staleness": 2, "workers": 2, "trace": True,
                                     "batch_size": 32, "model": "mlp32"})
    for rank, trace in enumerate(run["traces"]):
        compute = {text: (start, end) for text, start, end in trace if text[0] in "FB"}
        spans = run["sync_stats"][rank]["ring_spans"]
        overlapping = [mb for mb, start, end in spans
                       if any(f"{kind}{mb + 1}" in compute and compute[f"{kind}{mb + 1}"][0] < end
                              and start < compute[f"{kind}{mb + 1}"][1] for kind in "FB")]
        assert len(overlapping) >= len(spans) // 2, (spans[:4], sorted(compute.items())[:8])


def test_the_profiler_times_kernels_not_their_launch() -> None:
    """A layer of 2 x 4096^3 flops: the profile's forward is what CUDA events time it at, far above its
    launch alone."""
    torch.backends.cuda.matmul.allow_tf32 = False
    layer = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 8)).cuda()
    x = torch.randn(4096, 4096, device="cuda")
    profiled = profile_model(layer, x, repeats=5, warmup=2).layers[0].forward_s
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        layer[0](x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    timed = sorted(times)[2]
    assert 0.5 < profiled / timed < 2.0, (profiled, timed)


@pytest.mark.multiprocess
def test_bf16_autocast_on_the_gpu_trains_and_halves_the_activations_sent(tmp_path) -> None:
    fp32 = job(tmp_path, "fp32", {"stages": [0, 4], "model": "mlp32", "epochs": 2})
    bf16 = job(tmp_path, "bf16", {"stages": [0, 4], "model": "mlp32", "epochs": 2, "precision": "bf16"})
    losses = [h["loss"] for h in bf16["history"]]
    assert sum(losses[-4:]) < sum(losses[:4])
    assert bf16["bytes_sent"][0] == fp32["bytes_sent"][0] // 2  # stage 0 sends activations only


def test_export_captures_a_model_fx_cannot_trace_on_the_gpu() -> None:
    sys.path.insert(0, str(JOB.parent))
    from job import ShapeBranch

    model = ShapeBranch().cuda()
    x = torch.randn(16, 8, device="cuda")
    layers = LayeredModel(model, x)
    cut = len(layers) // 2 - 1
    first, second = layers.stage(0, cut), layers.stage(cut + 1, len(layers) - 1)
    torch.testing.assert_close(second(first(x)), model(x))


@pytest.mark.multiprocess
def test_a_checkpoint_written_on_the_gpu_resumes_on_the_cpu_and_back(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    options = {"stages": [0, 4], "checkpoint_dir": ckpt}
    job(tmp_path, "e0", {**options, "epochs": 1})
    job(tmp_path, "e1", {**options, "epochs": 2, "resume": True}, cpu=True)
    resumed = job(tmp_path, "e2", {**options, "epochs": 3, "resume": True})
    whole = job(tmp_path, "whole", {"stages": [0, 4], "epochs": 3})
    assert_close(resumed["state"], whole["state"])
