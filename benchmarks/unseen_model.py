"""A model no test or benchmark here was tuned on, planned automatically: is the prediction within 1.5x?

    flock /tmp/pipetrain-bench.lock python benchmarks/unseen_model.py [--workers 3] [--repeats 2] [--json F]

The model is a small Transformer language model built from ``torch.nn.TransformerEncoderLayer``, trained on characters of text that ships with Python
(:func:`pipetrain.zoo.char_lm_dataset`), over ``--workers`` local workers, twice per repeat: with
``strategy="auto"`` (pipetrain picks the strategy) and with ``stages="auto"`` (a PipeDream plan run by
``pipedream``). Each run prints pipetrain's prediction (``result.predicted_samples_per_s``, made before
training from a profile and the measured set-up) and the measured samples/s of the whole run.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
from typing import Any

import torch
from torch import nn

import pipetrain
from pipetrain import zoo

GOAL = 1.5


class Positions(nn.Module):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab: int, width: int, length: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(length, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[:ids.shape[1]]


def transformer_lm(width: int = 128, depth: int = 4, heads: int = 4, length: int = 64) -> nn.Sequential:
    """Embedding, ``depth`` encoder layers (causal mask left out: the cost is the same), vocabulary head."""
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True) for _ in range(depth)]
    return nn.Sequential(Positions(len(zoo.CHARS), width, length), *layers, nn.Linear(width, len(zoo.CHARS)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.transpose(1, 2), targets)


def run(kind: str, workers: int, epochs: int) -> dict[str, Any]:
    """One training run planned by ``kind`` (``strategy`` or ``stages``); its prediction and measurement."""
    how: dict[str, Any] = {"strategy": "auto"} if kind == "strategy" else {"stages": "auto", "schedule": "pipedream"}
    result = pipetrain.train(transformer_lm(), zoo.char_lm_dataset(64), loss_fn=lm_loss,
                             optimizer=functools.partial(torch.optim.Adam, lr=1e-3), workers=workers,
                             batch_size=12, epochs=epochs, seed=0, **how)
    predicted, measured = result.predicted_samples_per_s, result.samples_per_s
    picked = result.choice["choice"] if result.choice else f"pipeline {result.plan.config}"
    return {"kind": kind, "picked": picked, "predicted": predicted, "measured": measured,
            "ratio": max(predicted / measured, measured / predicted), "loss": result.history[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [run(kind, args.workers, args.epochs) for _ in range(args.repeats) for kind in ("strategy", "stages")]
    print("| planned by | picked | predicted samples/s | measured | off by | within 1.5x |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']}=\"auto\" | {r['picked']} | {r['predicted']:.0f} | {r['measured']:.0f} | "
              f"{r['ratio']:.2f}x | {'yes' if r['ratio'] <= GOAL else 'NO'} |")
    print(f"median off by {statistics.median(r['ratio'] for r in rows):.2f}x over {len(rows)} runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
