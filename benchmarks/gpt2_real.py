"""GPT-2 small at its real size (12 layers, width 768, vocabulary 50257, head tied to the token embedding
as GPT-2 has it, 124M parameters; sequences of 128, batch 8),
planned with ``stages="auto"`` on 2 workers: how long from the ``pipetrain.train`` call to the first
update, and where does that time go?

Token data is made here (no download): each sequence counts up by one from a random start in the first
1000 token ids, so the loss falls within a few updates. Prints one JSON line per run and a table of the
median run.

    PYTHONPATH=. python3 benchmarks/gpt2_real.py --runs 3
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

import pipetrain
from pipetrain.zoo import gpt_like

PHASES = ("capture_s", "profile_s", "setup_s", "plan_s", "memory_s", "start_s", "first_update_s")


def counting(n: int, seq: int, span: int = 1000, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` (input, target) pairs of ``seq`` token ids: a run counting up by one (mod ``span``) from a
    random start, the target the input shifted by one."""
    start = torch.randint(0, span, (n, 1), generator=torch.Generator().manual_seed(seed))
    ids = (start + torch.arange(seq + 1)) % span
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = gpt_like(args.vocab, args.width, args.depth, args.heads, args.seq, tied=not args.untied)
    data = counting(args.updates * args.batch, args.seq, span=min(1000, args.vocab))
    called = time.perf_counter()
    result = pipetrain.train(model, data, loss_fn=nn.functional.cross_entropy, stages="auto", workers=args.workers,
                             optimizer=functools.partial(torch.optim.Adam, lr=args.lr), batch_size=args.batch,
                             shuffle=False, timeout=600)
    ended = time.perf_counter()
    first = result.history[0]["time"] - result.started
    return {"first_update_s": first, "call_s": ended - called, "phases": result.phases,
            "samples_per_s": result.samples_per_s, "updates": len(result.history),
            "loss_first": result.history[0]["loss"], "loss_last": result.history[-1]["loss"],
            "plan": result.plan.config if result.plan else None,
            "boundaries": result.plan.boundaries if result.plan else None,
            "peak_memory_gib": [round(b / 2**30, 2) for b in result.peak_memory]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--untied", action="store_true", help="a head of its own, not the token embedding's")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        runs.append(one_run(args))
        print(json.dumps(runs[-1]), flush=True)
    runs.sort(key=lambda r: r["first_update_s"])
    median = runs[len(runs) // 2]
    print(f"call -> first update: median {statistics.median(r['first_update_s'] for r in runs):.1f} s "
          f"over {len(runs)} run(s): " + ", ".join(f"{r['first_update_s']:.1f}" for r in runs))
    print("| phase | seconds |\n|---|---|")
    for name in PHASES:
        if name in median["phases"]:
            print(f"| {name[:-2]} | {median['phases'][name]:.1f} |")
    print(f"rate {median['samples_per_s']:.2f} samples/s; loss {median['loss_first']:.3f} -> "
          f"{median['loss_last']:.3f} over {median['updates']} updates; plan {median['plan']} "
          f"{median['boundaries']}; peak memory per worker {median['peak_memory_gib']} GiB")


if __name__ == "__main__":
    main()
