"""Each flush schedule beside its ``torch.distributed.pipelining`` twin, on a transformer and a conv net.

    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/twins.py [--repeats 3] [--json F]

Per repeat and model, one ``pipetrain bench`` run (:func:`pipetrain.bench.suite.run_suite`) of four pairs,
1f1b-flush / torch-1f1b, gpipe / torch-gpipe, zero-bubble / torch-zero-bubble and interleaved-1f1b /
torch-interleaved-1f1b, each pair back to back on 2 emulated hosts (pipetrain first in odd repeats, torch
first in even ones, so the machine's drift falls on both sides alike), at one microbatch count. The ratio
is pipetrain's samples/s over its twin's in the same run; the table gives the median over repeats and
every run's ratio.

Then where a stage's step goes: each pipetrain schedule traced once on loopback, every worker's time
split into compute (``F``, ``B``, zero-bubble's ``I`` and ``W``), waiting for a message (``RF``, ``RB``),
sending, the update and time outside any action (the runtime's own bookkeeping); and, in this process,
one stage's backward whole against zero-bubble's two parts (the split's extra work).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

import torch

import pipetrain
from pipetrain.bench.suite import run_suite
from pipetrain.bench.systems import TWINS, SuiteConfig
from pipetrain.layers import LayeredModel
from pipetrain.runtime.split_backward import input_backward
from pipetrain.schedule.kinds import GPipe, Interleaved1F1B, OneFOneBFlush, ZeroBubble
from pipetrain.trace import seconds_by_kind
from pipetrain.zoo import SPECS

MODELS: dict[str, dict[str, Any]] = {"gpt-like": {"batch_size": 16, "stages": [0, 6]},
                                     "vgg-like": {"batch_size": 32, "stages": [0, 14]}}
"""Each model's batch and its 2-stage split (first layers), about even on one thread."""
OURS = ("1f1b-flush", "gpipe", "zero-bubble", "interleaved-1f1b")
SCHEDULES = {"1f1b-flush": OneFOneBFlush, "gpipe": GPipe, "zero-bubble": ZeroBubble,
             "interleaved-1f1b": Interleaved1F1B}


def side_by_side(model: str, link: str, microbatches: int, repeat: int) -> dict[str, float]:
    """samples/s of every system in one run, each pair back to back in the repeat's order."""
    order = [s for ours in OURS for s in ((ours, TWINS[ours]) if repeat % 2 == 0 else (TWINS[ours], ours))]
    cfg = SuiteConfig(model=model, link=link, batch_size=MODELS[model]["batch_size"], stages=MODELS[model]["stages"],
                      microbatches=(microbatches,), systems=tuple(order))
    report = run_suite(cfg, log=lambda line: print(f"  {line}", flush=True))
    return report["samples_per_s"]


def breakdown(model: str, schedule: str, microbatches: int, steps: int = 8) -> list[dict[str, float]]:
    """Per worker, the share of its traced time in each action kind and outside any action."""
    spec = SPECS[model]
    batch = MODELS[model]["batch_size"]
    n = len(LayeredModel(spec.factory()))
    looped = schedule == "interleaved-1f1b"
    stages: Any = [round(i * n / 4) for i in range(4)] if looped else MODELS[model]["stages"]
    torch.manual_seed(0)
    result = pipetrain.train(spec.factory(), spec.dataset(batch * steps), loss_fn=spec.loss_fn,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01), batch_size=batch,
                             schedule=SCHEDULES[schedule](microbatches=microbatches), stages=stages,
                             workers=2 if looped else None, threads=1, trace=True, shuffle=False)
    shares = []
    for records in result.traces:
        wall = records[-1][2] - records[0][1]
        spent = seconds_by_kind(records)
        spent["outside"] = wall - sum(spent.values())
        shares.append({k: v / wall for k, v in spent.items()})
    return shares


def split_cost(model: str, microbatches: int, repeats: int = 6) -> list[dict[str, float]]:
    """Per stage of the model's 2-stage split, one microbatch's backward whole against its input part
    and weight part (ms, median), in this process on one thread."""
    torch.set_num_threads(1)
    spec = SPECS[model]
    torch.manual_seed(0)
    layers = LayeredModel(spec.factory())
    bounds = MODELS[model]["stages"]
    pieces = list(layers.stages(bounds))
    x, _ = spec.dataset(MODELS[model]["batch_size"] // microbatches)[:]
    inputs = [x]
    with torch.no_grad():
        for piece in pieces[:-1]:
            inputs.append(piece(inputs[-1]))
    rows = []
    for k, piece in enumerate(pieces):
        whole, part_i, part_w = [], [], []
        for _ in range(repeats):
            for times in (whole, None):
                value = inputs[k].detach().requires_grad_(inputs[k].is_floating_point())
                out = piece(value)
                grad = torch.randn_like(out) * 1e-3
                t0 = time.perf_counter()
                if times is whole:
                    torch.autograd.backward([out], [grad])
                    whole.append(time.perf_counter() - t0)
                else:
                    _, weights = input_backward([out], [grad], [value] if value.requires_grad else [])
                    t1 = time.perf_counter()
                    weights.run()
                    part_i.append(t1 - t0)
                    part_w.append(time.perf_counter() - t1)
        ms = {name: 1e3 * statistics.median(v[1:]) for name, v in (("B", whole), ("I", part_i), ("W", part_w))}
        rows.append(ms)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--link", default="1gbit")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--skip-runs", action="store_true", help="only the traced breakdown and the split's cost")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    models = args.models.split(",")
    out: dict[str, Any] = {"ratios": {}, "runs": {}, "breakdown": {}, "split": {}}
    for model in models:
        out["split"][model] = split_cost(model, args.microbatches)
        out["breakdown"][model] = {s: breakdown(model, s, args.microbatches) for s in OURS}
    if not args.skip_runs:
        for r in range(args.repeats):
            for model in models:
                print(f"{model}, repeat {r + 1} of {args.repeats}", flush=True)
                out["runs"].setdefault(model, []).append(side_by_side(model, args.link, args.microbatches, r))
        for model, runs in out["runs"].items():
            out["ratios"][model] = {s: [run[s] / run[TWINS[s]] for run in runs if s in run and TWINS[s] in run]
                                    for s in OURS}
    print(f"\n{time.strftime('%Y-%m-%d')}, 2 emulated hosts at {args.link}, {args.microbatches} microbatches")
    for model in models:
        print(f"\n{model}: pipetrain / torch twin (median of {args.repeats}; each run)")
        for s in OURS if out["ratios"] else ():
            ratios = out["ratios"][model][s]
            rates = [f"{run.get(s, 0):.1f}/{run.get(TWINS[s], 0):.1f}" for run in out["runs"][model]]
            med = statistics.median(ratios) if ratios else float("nan")
            print(f"  {s:18s} {med:5.2f}x   runs {' '.join(f'{x:.2f}' for x in ratios)}   samples/s {' '.join(rates)}")
        print(f"{model}: share of each worker's traced time (loopback)")
        for s, shares in out["breakdown"][model].items():
            for w, share in enumerate(shares):
                parts = " ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(share.items()))
                print(f"  {s:18s} worker {w}: {parts}")
        for k, ms in enumerate(out["split"][model]):
            print(f"  stage {k} of 2, one microbatch: backward {ms['B']:.1f} ms whole, "
                  f"{ms['I']:.1f} + {ms['W']:.1f} = {ms['I'] + ms['W']:.1f} ms split")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
