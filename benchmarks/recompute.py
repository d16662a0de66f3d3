"""Activation recomputation: what a stage keeps between forward and backward, and what the rerun costs.

    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/recompute.py [--repeats 3] [--json F]

Question: how much of a stage's stashed bytes does ``recompute=True`` save, and how much slower is it?
The model: 2 stages of 2 blocks each, a block ``Linear(256, 2048) -> GELU -> Dropout(0.1) ->
Linear(2048, 256)`` (float32; what crosses a cut is 256 wide, the insides 2048), MSE loss, SGD, batch
64, ``--steps`` minibatches. Each schedule runs with and without recompute; the table gives each stage's
peak stashed activation and weight-version bytes (``TrainResult.stashed_bytes``, exact) and the median
samples/s of ``--repeats`` runs (after the first update).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain

BATCH, WIDTH, INSIDE = 64, 256, 2048
SCHEDULES = {"pipedream": "pipedream", "gpipe(m=4)": pipetrain.GPipe(4), "1f1b-flush(m=4)": pipetrain.OneFOneBFlush(4)}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [[nn.Linear(WIDTH, INSIDE), nn.GELU(), nn.Dropout(0.1), nn.Linear(INSIDE, WIDTH)] for _ in range(4)]
    return nn.Sequential(*[layer for block in blocks for layer in block])


def rate(history: list[dict]) -> float:
    """Samples/s from the first update to the last."""
    return (len(history) - 1) * BATCH / (history[-1]["time"] - history[0]["time"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(args.steps * BATCH, WIDTH, generator=g),
                         torch.randn(args.steps * BATCH, WIDTH, generator=g))
    rows = []
    print("| schedule | recompute | activation KiB per stage | weight-version KiB per stage | samples/s |")
    print("|---|---|---|---|---|")
    for name, schedule in SCHEDULES.items():
        for recompute in (False, True):
            runs = [pipetrain.train(model(), data, loss_fn=nn.functional.mse_loss,
                                    optimizer=functools.partial(torch.optim.SGD, lr=0.01), stages=[0, 8],
                                    schedule=schedule, batch_size=BATCH, shuffle=False, recompute=recompute)
                    for _ in range(args.repeats)]
            stashed = runs[0].stashed_bytes
            row = {"schedule": name, "recompute": recompute,
                   "activation_bytes": [s["activation_bytes"] for s in stashed],
                   "weight_bytes": [s["weight_bytes"] for s in stashed],
                   "samples_per_s": statistics.median(rate(r.history) for r in runs)}
            rows.append(row)
            kib = [round(b / 1024) for b in row["activation_bytes"]], [round(b / 1024) for b in row["weight_bytes"]]
            print(f"| {name} | {recompute} | {kib[0]} | {kib[1]} | {row['samples_per_s']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
