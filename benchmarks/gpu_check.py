"""Does every CUDA path work on this machine's GPU, and what does a GPT-2-sized model cost there?

    python benchmarks/gpu_check.py OUT_DIR            # on a machine with a GPU, within about 8 minutes
    python benchmarks/gpu_check.py OUT_DIR --dry-run  # the same table on the CPU with a tiny model, no tests

First it runs ``tests/gpu`` (pipelines and CGDP sharing the GPU over gloo, the ring's codecs on GPU
tensors, Pipe-SGD's overlap, the profiler, bf16, torch.export, checkpoints across devices). Then it
measures, on GPT-2 small's shape built from ``torch.nn`` (:func:`pipetrain.zoo.gpt_like`: 12 blocks of
width 768, a 50257-token vocabulary, 163M parameters untied):

* one worker's training step (forward, backward, AdamW), float32 and under bf16 autocast;
* ``pipedream`` over 2 stages sharing the GPU (2 workers over gloo) against one worker;
* CGDP against DDP, 2 workers sharing the GPU over gloo: samples/s and seconds per iteration;
* the profiler's predicted step (its layers' forward, backward and optimizer summed) against the
  measured float32 step.

It writes ``gpu_check.json`` and ``gpu_check.md`` (the table) to OUT_DIR and prints as it goes. It
installs nothing: run it from the repository with the machine's own PyTorch, pipetrain on the path
(``PYTHONPATH=.`` or ``pip install --no-deps --no-build-isolation -e .``). Without a CUDA device it
stops at once with one line.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain import zoo
from pipetrain.profiling import profile_model

ROOT = Path(__file__).resolve().parents[1]
GPT2 = {"vocab": 50257, "width": 768, "depth": 12, "heads": 12, "context": 1024}
TINY = {"vocab": 500, "width": 64, "depth": 4, "heads": 4, "context": 32}


def say(line: str) -> None:
    print(f"gpu_check: {line}", flush=True)


def run_tests() -> dict[str, Any]:
    """``pytest tests/gpu``, its output passed through as it comes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-u", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                             "tests/gpu"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        tail = (tail + [line.rstrip()])[-40:]
    return {"exit_code": proc.wait(), "seconds": time.perf_counter() - t0, "tail": tail}


def tokens(n: int, seq: int, vocab: int, seed: int = 0) -> TensorDataset:
    """``n`` windows of random token ids and their next tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (n, seq + 1), generator=g)
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def step_seconds(size: dict[str, int], batch: int, seq: int, device: torch.device, bf16: bool,
                 repeats: int) -> float:
    """Median seconds of one worker's training step (forward, loss, backward, AdamW) on ``device``."""
    torch.manual_seed(0)
    model = zoo.gpt_like(**size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = (t.to(device) for t in tokens(batch, seq, size["vocab"])[:])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    times = []
    for k in range(repeats + 3):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if k >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profiled_step_seconds(size: dict[str, int], batch: int, seq: int, device: torch.device) -> float:
    """The profiler's step: every layer's forward and backward and AdamW step summed (float32)."""
    torch.manual_seed(0)
    model = zoo.gpt_like(**size).to(device)
    x, y = (t.to(device) for t in tokens(batch, seq, size["vocab"])[:])
    found = profile_model(model, (x, y), F.cross_entropy, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                          repeats=3, warmup=1)
    return sum(layer.forward_s + layer.backward_s + layer.optimizer_s for layer in found.layers)


def trained(size: dict[str, int], batch: int, seq: int, steps: int, **how: Any) -> dict[str, Any]:
    """``pipetrain.train`` on ``steps`` minibatches of random tokens; its samples/s and seconds per step."""
    torch.manual_seed(0)
    data = tokens(batch * steps, seq, size["vocab"], seed=1)
    result = pipetrain.train(zoo.gpt_like(**size), data, loss_fn=F.cross_entropy,
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), batch_size=batch, epochs=1,
                             shuffle=False, timeout=300, **how)
    return {"samples_per_s": result.samples_per_s, "step_s": batch / result.samples_per_s,
            "loss": [result.history[0]["loss"], result.history[-1]["loss"]]}


def guarded(name: str, measure: Callable[[], Any], found: dict[str, Any]) -> None:
    """``found[name] = measure()``, or the error it raised: one row failing leaves the others."""
    say(f"measuring {name} ...")
    t0 = time.perf_counter()
    try:
        found[name] = measure()
    except Exception as e:  # noqa: BLE001 - the table says what failed and goes on
        found[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        traceback.print_exc()
    say(f"{name}: {found[name]} ({time.perf_counter() - t0:.0f} s)")


def table(found: dict[str, Any], device: str, size: dict[str, int], batch: int, seq: int) -> str:
    """The Markdown table of what :func:`main` measured."""
    def cell(key: str, field: str, fmt: str) -> str:
        value = found.get(key, {})
        return format(value[field], fmt) if field in value else "-"

    def ratio(a: str, b: str) -> str:
        x, y = found.get(a, {}), found.get(b, {})
        return f"{x['samples_per_s'] / y['samples_per_s']:.2f}x" if "samples_per_s" in x and "samples_per_s" in y else "-"

    one = found.get("one worker step", {})
    lines = [f"{device}; model: gpt_like({', '.join(f'{k}={v}' for k, v in size.items())}), batch {batch} x {seq} "
             "tokens, AdamW", "",
             "| what | samples/s | seconds per step | against |", "|---|---|---|---|"]
    for key in ("fp32", "bf16"):
        if key in one:
            lines.append(f"| one worker, {key} step (in-process) | {batch / one[key]:.1f} | {one[key]:.4f} | |")
    if "error" in one:
        lines.append(f"| one worker step | {one['error']} | | |")
    rows = [("one worker (pipetrain, stages=[0])", "one worker", ""),
            ("pipedream, 2 stages sharing the GPU (gloo)", "pipedream 2 stages", ratio("pipedream 2 stages", "one worker")),
            ("DDP, 2 workers sharing the GPU (gloo)", "ddp 2 workers", ""),
            ("CGDP, 2 workers sharing the GPU", "cgdp 2 workers", ratio("cgdp 2 workers", "ddp 2 workers"))]
    for label, key, against in rows:
        failed = found.get(key, {}).get("error")
        lines.append(f"| {label} | failed: {failed} | | |" if failed else
                     f"| {label} | {cell(key, 'samples_per_s', '.1f')} | {cell(key, 'step_s', '.4f')} | {against} |")
    predicted, measured = found.get("profiler predicted step"), one.get("fp32")
    if isinstance(predicted, float) and measured:
        lines += ["", f"The profiler's predicted float32 step: {predicted:.4f} s against {measured:.4f} s measured "
                      f"({predicted / measured - 1:+.0%})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--dry-run", action="store_true", help="the table on the CPU with a tiny model, no tests")
    parser.add_argument("--steps", type=int, default=12, help="minibatches per training run (default 12)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per minibatch (default 8)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256; dry run 32)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a machine with a GPU, "
              "or add --dry-run for the table on the CPU")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size, seq = (TINY, min(args.seq, TINY["context"])) if args.dry_run else (GPT2, args.seq)
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = "CPU (dry run)" if args.dry_run else f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    say(f"on {name}")
    found: dict[str, Any] = {"device": name, "size": size, "batch": args.batch, "seq": seq, "steps": args.steps}
    if not args.dry_run:
        say("running tests/gpu ...")
        found["tests"] = run_tests()
        say(f"tests/gpu: exit {found['tests']['exit_code']} in {found['tests']['seconds']:.0f} s")
    guarded("one worker step", lambda: {"fp32": step_seconds(size, args.batch, seq, device, False, 10),
                                        "bf16": step_seconds(size, args.batch, seq, device, True, 10)}, found)
    guarded("profiler predicted step", lambda: profiled_step_seconds(size, args.batch, seq, device), found)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    common = {"backend": "gloo"}
    guarded("one worker", lambda: trained(size, args.batch, seq, args.steps, stages=[0], **common), found)
    split = 1 + size["depth"] // 2  # the token embedding and half the blocks on stage 0
    guarded("pipedream 2 stages", lambda: trained(size, args.batch, seq, args.steps, stages=[0, split], **common),
            found)
    guarded("ddp 2 workers", lambda: trained(size, args.batch, seq, args.steps, strategy="ddp", workers=2, **common),
            found)
    guarded("cgdp 2 workers", lambda: trained(size, args.batch, seq, args.steps, strategy="cgdp", workers=2,
                                              **common), found)
    text = table(found, name, size, args.batch, seq)
    (out / "gpu_check.json").write_text(json.dumps(found, indent=1, default=str))
    (out / "gpu_check.md").write_text(text + "\n")
    print(text, flush=True)
    say(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0 if found.get("tests", {}).get("exit_code", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
