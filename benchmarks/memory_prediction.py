"""Predicted against measured peak memory per worker, for pipelines and data parallelism.

    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/memory_prediction.py [--check 0.2] [--json F]

Question: how close is ``TrainResult.predicted_memory`` (what pipetrain predicts before it trains) to what
each worker measures (``TrainResult.measured_memory``: the process's peak resident memory on the CPU,
``torch.cuda.max_memory_allocated`` on a GPU)? The model: an MLP of 512 -> 2048 -> 2048 -> 2048 -> 10
(float32, 16 MB per 2048-wide layer, so a stage's weights, gradients and optimizer state stand out of a
worker's baseline of some 250 MB), batch 64, ``--steps`` minibatches, run as a pipeline of 2 stages under
three schedules, as 2 data-parallel workers under two strategies, and built on the meta device with
``stages="auto"``. ``--check F`` exits 1 when a worker's prediction is off by more than the fraction F.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain

BATCH = 64
ADAM = functools.partial(torch.optim.Adam, lr=1e-3)
MOMENTUM = functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                         nn.ReLU(), nn.Linear(2048, 10))


def on_meta() -> nn.Sequential:
    with torch.device("meta"):
        return model()


JOBS: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "pipedream, Adam": (model, {"stages": [0, 4], "optimizer": ADAM}),
    "gpipe m=4, momentum": (model, {"stages": [0, 4], "schedule": pipetrain.GPipe(4), "optimizer": MOMENTUM}),
    "1f1b-flush m=4 +recompute, Adam": (model, {"stages": [0, 4], "schedule": pipetrain.OneFOneBFlush(4),
                                                "recompute": True, "optimizer": ADAM}),
    "ddp, Adam": (model, {"strategy": "ddp", "workers": 2, "optimizer": ADAM}),
    "pipe-sgd K=2, Adam": (model, {"strategy": "pipe-sgd", "workers": 2, "optimizer": ADAM}),
    "meta model, stages auto, Adam": (on_meta, {"stages": "auto", "workers": 2, "optimizer": ADAM, "save": None}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--check", type=float, default=None, help="exit 1 when a prediction is off by more than this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(args.steps * BATCH, 512, generator=g),
                         torch.randint(0, 10, (args.steps * BATCH,), generator=g))
    rows = []
    print("| job | worker | predicted MiB | measured MiB | error |")
    print("|---|---|---|---|---|")
    for name, (build, options) in JOBS.items():
        result = pipetrain.train(build(), data, loss_fn=nn.functional.cross_entropy, batch_size=BATCH, **options)
        for rank, (predicted, measured) in enumerate(zip(result.predicted_memory, result.measured_memory)):
            row = {"job": name, "worker": rank, "predicted": predicted, "measured": measured,
                   "error": predicted / measured - 1}
            rows.append(row)
            print(f"| {name} | {rank} | {predicted / 2**20:.0f} | {measured / 2**20:.0f} | {row['error']:+.0%} |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.check is not None and any(abs(r["error"]) > args.check for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
