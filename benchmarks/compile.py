"""Compiled stages against eager ones: samples/s and what compiling costs.

    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/compile.py --model gpt [--repeats 3]
    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/compile.py --model vgg

Question: how much faster does ``train(compile=True)`` train than eager on this CPU, and what does the
compilation cost? Models: ``gpt_like(vocab=4096, width=256, depth=8, heads=8, context=64)`` on batches of 16
random 64-token sequences, or ``vgg_like()`` (26.8M parameters) on batches of 32 random 32x32 images;
float32, cross entropy, SGD. Each runs as a 2-stage ``1f1b-flush`` pipeline (cut in the middle of its
layers) and as ``ddp`` on 2 workers, eager and compiled alternating, ``--repeats`` times each; each run
makes ``--steps`` updates. samples/s: from the second update to the last (the first one compiles);
"first update s": the first update's seconds less a steady one's, i.e. the compilation (with
inductor's on-disk cache as the earlier runs left it: the first run of a fresh machine pays more,
reported as "first run"). Medians of the repeats.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.zoo import gpt_like, vgg_like


def gpt() -> tuple[nn.Module, TensorDataset, int, list[int]]:
    torch.manual_seed(0)
    net = gpt_like(vocab=4096, width=256, depth=8, heads=8, context=64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4096, (16 * 64, 65), generator=g)
    return net, TensorDataset(ids[:, :-1], ids[:, 1:]), 16, [0, 6]


def vgg() -> tuple[nn.Module, TensorDataset, int, list[int]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32 * 64, 3, 32, 32, generator=g), torch.randint(10, (32 * 64,), generator=g))
    return vgg_like(), data, 32, [0, 12]


MODELS = {"gpt": gpt, "vgg": vgg}


def one_run(which: str, setup: str, compiled: bool, steps: int) -> dict[str, float]:
    net, data, batch, stages = MODELS[which]()
    where: dict[str, Any] = dict(strategy="ddp", workers=2) if setup == "ddp" else \
        dict(schedule="1f1b-flush", stages=stages)
    began = time.perf_counter()
    result = pipetrain.train(net, data, loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01), batch_size=batch, shuffle=False,
                             max_steps=steps, compile=compiled, timeout=600, **where)
    wall = time.perf_counter() - began
    h = result.history
    steady = [h[i]["time"] - h[i - 1]["time"] for i in range(2, len(h))]
    first = batch / h[0]["samples_per_s"]
    return {"samples_per_s": (len(h) - 2) * batch / (h[-1]["time"] - h[1]["time"]),
            "first_extra_s": first - statistics.median(steady), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for setup in ("1f1b-flush", "ddp"):
            for compiled in (False, True):  # side by side, so both see the same phases of the machine
                runs.setdefault((setup, compiled), []).append(one_run(args.model, setup, compiled, args.steps))
    print(f"| {args.model} | mode | samples/s | x eager | first update extra s (first run) | run wall s |")
    print("|---|---|---|---|---|---|")
    rows = []
    for setup in ("1f1b-flush", "ddp"):
        eager = statistics.median(r["samples_per_s"] for r in runs[(setup, False)])
        for compiled in (False, True):
            rs = runs[(setup, compiled)]
            row = {"model": args.model, "setup": setup, "compiled": compiled,
                   "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                   "first_extra_s": statistics.median(r["first_extra_s"] for r in rs),
                   "first_run_extra_s": rs[0]["first_extra_s"], "wall_s": statistics.median(r["wall_s"] for r in rs)}
            rows.append(row)
            print(f"| {setup} | {'compiled' if compiled else 'eager'} | {row['samples_per_s']:.1f} | "
                  f"{row['samples_per_s'] / eager:.2f} | {row['first_extra_s']:.1f} ({row['first_run_extra_s']:.1f}) | "
                  f"{row['wall_s']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
