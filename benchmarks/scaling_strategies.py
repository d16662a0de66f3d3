"""Where each strategy wins from 8 to 1024 workers, as the planner predicts it.

    flock /tmp/pipetrain-bench.lock python benchmarks/scaling_strategies.py --jsonl strategies.jsonl
    python benchmarks/scaling_strategies.py --table strategies.jsonl [--png docs/scaling.png]

For each PipeDream profile (default: the ones shipped in ``pipetrain/data/pipedream``), link and worker
count, the samples/s ``pipetrain plan --strategies all`` predicts for the planned pipeline (``pipedream`` on
the plan ``pipetrain plan`` prints), ``ddp`` and ``pipe-sgd`` with each codec, and what ``schedule="auto"``
picks for the pipeline, with the planner's own seconds. Each profile's layer times are taken as those
of ``--batch`` samples (PipeDream's graph files record no batch size), and since the profiles carry no
run set-up every figure is a compute-only bound that charges the links their bytes.

* **weak scaling**: each worker's share of a step stays ``--batch`` samples. Data parallelism trains
  minibatches of ``batch x workers``, one shard per worker; a pipeline trains minibatches of ``batch``, a
  replicated stage one minibatch per replica (PipeDream's comparison: 32 samples per machine).
* **strong scaling**: every strategy trains minibatches of ``--global-batch`` samples (the profile's
  times and bytes scaled up to it); data parallelism splits each into ``global / workers`` shards.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipetrain.planning import parse_bandwidth
from pipetrain.planning.choose import CANDIDATES
from pipetrain.planning.schedules import choose_schedule
from pipetrain.profiling import Profile, as_minibatch
from pipetrain.simulate import Link
from scaling import grid_options, keep_point, read_points

STRATEGIES = ("pipeline", "ddp", "pipe-sgd", "pipe-sgd-trunc16", "pipe-sgd-quant8")
SHORT = {"pipeline": "pipe", "ddp": "ddp", "pipe-sgd": "psgd", "pipe-sgd-trunc16": "t16", "pipe-sgd-quant8": "q8"}


def point(profile: Profile, workers: int, bandwidth: str, mode: str, batch: int, global_batch: int) -> dict[str, Any]:
    """Every strategy's predicted samples/s at one grid point (None: it cannot run there), the plan the
    pipeline runs and the schedule ``schedule="auto"`` picks for it, and the planner's seconds."""
    link = Link(parse_bandwidth(bandwidth))
    at = replace(profile, batch_size=batch) if mode == "weak" else as_minibatch(replace(profile, batch_size=batch),
                                                                              global_batch // batch)
    rates: dict[str, float | None] = {}
    config, plan_s = "", 0.0
    begun = time.perf_counter()
    for name in STRATEGIES:
        candidate = CANDIDATES[name]
        job = at.batch_size if name == "pipeline" or mode == "strong" else batch * workers
        if candidate.cannot_run(workers, job, False):
            rates[name] = None
            continue
        priced = candidate.predict(at, workers, link, job)
        rates[name] = None if priced.skip else priced.samples_per_s
        if name == "pipeline":
            config = f"{priced.plan.config} ({priced.plan.workers})" if priced.plan is not None else ""
            plan_s = time.perf_counter() - begun
    begun = time.perf_counter()
    try:
        choice = choose_schedule(at, workers, bandwidth, at.batch_size, link=link)
        schedule, scheduled = choice.chosen.label, choice.chosen.samples_per_s
    except ValueError:
        schedule, scheduled = "-", None
    return {"workers": workers, "bandwidth": bandwidth, "mode": mode, "rates": rates, "plan": config,
            "schedule": schedule, "scheduled": scheduled, "plan_s": plan_s, "schedule_s": time.perf_counter() - begun}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    grid_options(parser)
    parser.add_argument("--modes", default="weak,strong")
    parser.add_argument("--batch", type=int, default=64, help="samples each profile's layer times are for")
    parser.add_argument("--global-batch", type=int, default=1024, help="strong scaling's minibatch")
    parser.add_argument("--png", help="with --table: also draw samples/s against workers, one panel per profile and mode")
    args = parser.parse_args(argv)
    if args.table:
        rows = read_points(args.table)
        table(rows)
        if args.png:
            draw(rows, args.png)
        return 0
    rows = []
    for path in args.profiles.split(","):
        profile = Profile.load(path)
        name = Path(path).name.split(".")[0]
        for mode in args.modes.split(","):
            for bandwidth in args.bandwidths.split(","):
                for workers in sorted(int(w) for w in args.workers.split(",")):
                    row = {"profile": name, **point(profile, workers, bandwidth, mode, args.batch, args.global_batch)}
                    rows.append(row)
                    keep_point(args.jsonl, row)
                    cells = " ".join(f"{SHORT[k]} {v:.0f}" if v else f"{SHORT[k]} -" for k, v in row["rates"].items())
                    print(f"{name} {mode} {bandwidth} {workers}: {cells}; plan {row['plan']}; schedule auto "
                          f"{row['schedule']}; planner {row['plan_s']:.1f} s + {row['schedule_s']:.1f} s", flush=True)
    table(rows)
    return 0


def winner(row: dict[str, Any]) -> tuple[str, float]:
    """The strategy predicted fastest at a point and its samples/s."""
    best = max((k for k, v in row["rates"].items() if v), key=lambda k: row["rates"][k])
    return best, row["rates"][best]


def table(rows: list[dict[str, Any]]) -> None:
    """Per profile, mode and link: at each worker count the fastest strategy and its samples/s (thousands
    where large), the exact strategies' best where a codec wins; then the planner's slowest time."""
    counts = sorted({r["workers"] for r in rows})
    print("| profile | scaling | link | " + " | ".join(map(str, counts)) + " | planner s (max) |")
    print("|---|---|---|" + "---|" * len(counts) + "---|")
    keys = dict.fromkeys((r["profile"], r["mode"], r["bandwidth"]) for r in rows)
    for key in keys:
        mine = {r["workers"]: r for r in rows if (r["profile"], r["mode"], r["bandwidth"]) == key}
        cells = []
        for c in counts:
            if c not in mine:
                cells.append("-")
                continue
            name, rate = winner(mine[c])
            cells.append(f"{SHORT[name]} {_k(rate)}")
        slow = max(r["plan_s"] + r["schedule_s"] for r in mine.values())
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {slow:.1f} |")


def _k(rate: float) -> str:
    return f"{rate / 1000:.1f}k" if rate >= 10_000 else f"{rate:.0f}"


def draw(rows: list[dict[str, Any]], png: str) -> None:
    """samples/s against workers (log-log), a line per strategy, one panel per profile and mode, at 10
    Gbit/s (or the first link the rows hold)."""
    import matplotlib  # noqa: PLC0415 - only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    links = list(dict.fromkeys(r["bandwidth"] for r in rows))
    link = "10Gbit" if "10Gbit" in links else links[0]
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(len(modes), len(profiles), figsize=(3.2 * len(profiles), 3.0 * len(modes)),
                             squeeze=False)
    for i, mode in enumerate(modes):
        for j, profile in enumerate(profiles):
            ax = axes[i][j]
            mine = sorted((r for r in rows if (r["profile"], r["mode"], r["bandwidth"]) == (profile, mode, link)),
                          key=lambda r: r["workers"])
            for name in STRATEGIES:
                points = [(r["workers"], r["rates"][name]) for r in mine if r["rates"].get(name)]
                if points:
                    ax.plot(*zip(*points), marker="o", markersize=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{profile}, {mode}", fontsize=9)
            ax.set_xlabel("workers", fontsize=8)
            if j == 0:
                ax.set_ylabel("samples/s (predicted)", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Predicted samples/s against workers at {link}/s, compute-only bounds", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
