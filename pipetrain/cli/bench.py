"""``pipetrain bench``: pipetrain's schedules and strategies beside PyTorch DDP,
``torch.distributed.pipelining`` and a parameter server, on one model and link (see
:mod:`pipetrain.bench.suite`)."""
from __future__ import annotations

import argparse
import json
import sys

from pipetrain.bench.plot import plot
from pipetrain.bench.report import format_table
from pipetrain.bench.suite import run_suite
from pipetrain.bench.systems import EXTRA_SYSTEMS, QUICK, SYSTEMS, SuiteConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vgg-like", help="a pipetrain.zoo model (default vgg-like)")
    p.add_argument("--workers", type=int, default=2, help="one per emulated host (default 2); ps-sync adds a host for its server")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--link", default="1gbit", help="each host's rate, tc units (default 1gbit); "
                                                       "also what the automatic plan assumes")
    where.add_argument("--loopback", action="store_true", help="local processes on 127.0.0.1, no emulated link")
    p.add_argument("--batch-size", type=int, default=32, help="samples per optimizer update, every system")
    p.add_argument("--stages", default=None, help="split for every pipeline, e.g. 0,12 (default: the automatic plan's)")
    p.add_argument("--microbatches", default="1,2,4", help="counts tried for microbatched systems (default 1,2,4)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {', '.join(SYSTEMS + EXTRA_SYSTEMS)} (default: all but "
                        f"{', '.join(EXTRA_SYSTEMS)})")
    p.add_argument("--quick", action="store_true", help="fewer, shorter timed windows (a few minutes)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3, quick 2)")
    p.add_argument("--windows", type=int, default=None, help="timed windows (default 5, quick 3)")
    p.add_argument("--steps-per-window", type=int, default=None, help="(default 3, quick 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait on a silent peer")
    p.add_argument("--auto", action="store_true", help="also let strategy auto choose (from a profile and set-up "
                                                       "measured first) and judge its pick against the runs")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--png", default=None, help="write a bar chart of samples/s and bytes/sample here")


def config_from_args(args: argparse.Namespace) -> SuiteConfig:
    preset = QUICK if args.quick else {}
    chosen = {k: getattr(args, k) if getattr(args, k) is not None else preset.get(k, getattr(SuiteConfig, k))
              for k in ("warmup", "windows", "steps_per_window")}
    return SuiteConfig(
        model=args.model, workers=args.workers, link=args.link, loopback=args.loopback,
        batch_size=args.batch_size, stages=[int(b) for b in args.stages.split(",")] if args.stages else None,
        microbatches=tuple(int(m) for m in args.microbatches.split(",")),
        systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()), threads=args.threads,
        bound_repeats=preset.get("bound_repeats", SuiteConfig.bound_repeats), timeout_s=args.timeout,
        auto=args.auto, **chosen)


def cmd_bench(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    report = run_suite(cfg, log=lambda line: print(f"pipetrain bench: {line}", file=sys.stderr, flush=True))
    if args.png:
        plot(report, args.png)
    print(json.dumps(report) if args.json else format_table(report))
    if args.png and not args.json:
        print(f"wrote {args.png}")
    missing = [s for s in cfg.systems if s not in report["samples_per_s"]]
    if missing:
        raise RuntimeError(f"no result for {', '.join(missing)} (see the failures above)")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand to the ``pipetrain`` command."""
    p = sub.add_parser("bench", help="pipetrain's schedules beside PyTorch DDP and pipelining, same model and link",
                       description="pipetrain's schedules beside PyTorch DDP and torch.distributed.pipelining: "
                                   "same model, data, batch, workers and emulated link")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
