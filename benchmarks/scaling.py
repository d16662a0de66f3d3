"""Does the plan ``pipetrain plan`` picks hold from 8 to 1024 workers?

    flock /tmp/pipetrain-bench.lock python benchmarks/scaling.py [--profiles F,...] [--workers 8,16,...]
        [--bandwidths 1Gbit,10Gbit,25Gbit] [--jsonl F]

For each PipeDream profile (default: the ones shipped in ``pipetrain/data/pipedream``), link and worker
count, the planner runs as ``pipetrain plan`` runs it: the partitioner (PipeDream §3.2) proposes its plan,
its plans for each halving of the workers and their ties for fewer workers, from its paper's model and
from one whose replicated stages add their sync to their compute (two solves); the simulator
prices each in a steady-state window and the fastest (of equal ones the fewest workers) is the plan, its
rate the figure printed. Per point the script reports:

* the printed minibatches/s against the same plan simulated in a window twice as long (met within 10%);
* the partitioner's own figure (1 / its slowest stage or boundary) against the printed one;
* whether the plan is at least as fast as the plan printed for the previous (fewer) workers;
* whether the simulator overruled the partitioner (another plan, or fewer workers than asked);
* the planner's own seconds (met under 30 s).

Minibatches/s, since PipeDream's graph files record no batch size.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipetrain.planning import parse_bandwidth
from pipetrain.predict.pipeline import best_plan, propose, simulate_steady, window_minibatches
from pipetrain.profiling import Profile
from pipetrain.simulate import Link

SHIPPED = Path(__file__).resolve().parents[1] / "pipetrain" / "data" / "pipedream"
WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)
BANDWIDTHS = ("1Gbit", "10Gbit", "25Gbit")


def point(profile: Profile, workers: int, bandwidth: str) -> dict[str, Any]:
    """One grid point: the plan, its printed rate, the rate of a window twice as long, the partitioner's."""
    link = Link(parse_bandwidth(bandwidth))
    begun = time.perf_counter()
    found = propose(profile, workers, bandwidth)
    chosen = best_plan(profile, found, link)
    plan_s = time.perf_counter() - begun
    printed = chosen.options["simulated"][f"{chosen.workers}:{chosen.config}"]
    longer = 2 * window_minibatches(chosen.replicas)
    check = simulate_steady(profile, chosen, link, minibatches=longer).minibatches_per_s
    return {"workers": workers, "bandwidth": bandwidth, "config": chosen.config, "used": chosen.workers,
            "partitioner_config": found.config, "printed": printed, "longer": check,
            "partitioner": 1 / chosen.stage_time_s, "partitioner_own": 1 / found.stage_time_s,
            "partitioner_own_simulated": chosen.options["simulated"][f"{found.workers}:{found.config}"],
            "plan_s": plan_s}


def grid_options(parser: argparse.ArgumentParser) -> None:
    """The grid's options, shared with ``scaling_strategies.py``: profiles, worker counts, links, and the
    JSON-lines file the points go to or come back from."""
    parser.add_argument("--profiles", default=",".join(str(p) for p in sorted(SHIPPED.glob("*.graph.txt"))),
                        help="comma-separated profile files")
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)))
    parser.add_argument("--bandwidths", default=",".join(BANDWIDTHS))
    parser.add_argument("--jsonl", help="append each point as a JSON line to this file")
    parser.add_argument("--table", metavar="JSONL", help="only print the table of points an earlier --jsonl holds")


def read_points(path: str) -> list[dict[str, Any]]:
    """The points a ``--jsonl`` file holds."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def keep_point(path: str | None, row: dict[str, Any]) -> None:
    """Append ``row`` to the ``--jsonl`` file, if one was given."""
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    grid_options(parser)
    args = parser.parse_args(argv)
    if args.table:
        rows = read_points(args.table)
        grid(rows)
        summarize(rows)
        return 0
    counts = sorted(int(w) for w in args.workers.split(","))
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {platform.processor() or 'cpu'}")
    print("| profile | link | workers | plan (workers used) | printed mb/s | 2x window | partitioner's 1/period "
          "(its own plan: model / simulated) | >= fewer | planner s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for path in args.profiles.split(","):
        profile = Profile.load(path)
        name = Path(path).name.split(".")[0]
        for bandwidth in args.bandwidths.split(","):
            best_fewer = 0.0
            for workers in counts:
                row = {"profile": name, **point(profile, workers, bandwidth)}
                row["holds"] = row["printed"] >= best_fewer * (1 - 1e-9)
                best_fewer = max(best_fewer, row["printed"])
                rows.append(row)
                keep_point(args.jsonl, row)
                print(f"| {name} | {bandwidth} | {workers} | {row['config']} ({row['used']}) | {row['printed']:.1f} | "
                      f"{row['longer']:.1f} | {row['partitioner']:.1f} ({row['partitioner_config']}: "
                      f"{row['partitioner_own']:.1f} / {row['partitioner_own_simulated']:.1f}) | "
                      f"{'yes' if row['holds'] else 'NO'} | {row['plan_s']:.1f} |", flush=True)
    summarize(rows)
    return 0


def grid(rows: list[dict[str, Any]]) -> None:
    """One line per profile and link: each worker count's printed minibatches/s (workers used, where
    fewer), and the planner's slowest time."""
    counts = sorted({r["workers"] for r in rows})
    print("| profile | link | " + " | ".join(map(str, counts)) + " | planner s (max) |")
    print("|---|---|" + "---|" * len(counts) + "---|")
    keys = dict.fromkeys((r["profile"], r["bandwidth"]) for r in rows)
    for name, bandwidth in keys:
        mine = {r["workers"]: r for r in rows if (r["profile"], r["bandwidth"]) == (name, bandwidth)}
        cells = [f"{mine[c]['printed']:.1f}" + (f" ({mine[c]['used']})" if mine[c]["used"] < c else "")
                 + ("" if mine[c]["holds"] else " NO") if c in mine else "-" for c in counts]
        print(f"| {name} | {bandwidth} | " + " | ".join(cells) + f" | {max(r['plan_s'] for r in mine.values()):.1f} |")


def summarize(rows: list[dict[str, Any]]) -> None:
    """Counts of points meeting each criterion, and the worst ones."""
    def off(r: dict[str, Any]) -> float:
        return abs(r["printed"] / r["longer"] - 1)
    n = len(rows)
    print(f"\nwithin 10% of a window twice as long: {sum(off(r) <= 0.10 for r in rows)}/{n} "
          f"(worst {max(map(off, rows)):.1%})")
    print(f"at least as fast as the plan for fewer workers: {sum(r['holds'] for r in rows)}/{n}")
    print(f"uses fewer workers than asked: {sum(r['used'] < r['workers'] for r in rows)}/{n}; "
          f"simulator overruled the partitioner's plan: {sum(r['config'] != r['partitioner_config'] for r in rows)}/{n}")
    model = [abs(r["partitioner_own_simulated"] * r["partitioner_own"] ** -1 - 1) for r in rows]
    print(f"partitioner's own plan within 10% of its simulation: {sum(m <= 0.10 for m in model)}/{n} "
          f"(worst {max(model):.0%} off)")
    slow = max(rows, key=lambda r: r["plan_s"])
    print(f"planner's time: max {slow['plan_s']:.1f} s ({slow['profile']}, {slow['workers']} workers, "
          f"{slow['bandwidth']}); under 30 s: {sum(r['plan_s'] < 30 for r in rows)}/{n}")


if __name__ == "__main__":
    sys.exit(main())
