"""Replicated pipeline plans on the emulated cluster: does the partitioner's model (PipeDream §3.2) or
the simulator predict what a real run of the same plan measures?

    flock /tmp/pipetrain-bench.lock python benchmarks/replicated_plans.py --json rp.json   # about 10 min
    python benchmarks/replicated_plans.py --smoke   # a tiny model, 1 run each: the script end to end

Four emulated hosts at ``--link`` (:class:`pipetrain.bench.cluster.EmulatedCluster`; loopback where it
cannot be built), one single-thread worker each. The model is Pipe-SGD's MNIST perceptron with three
hidden layers of ``--hidden`` (zoo ``mnist-mlp``) at ``--batch-size``: weights heavy enough that a
replicated stage's sync takes about as long as its compute, which is where §3.2 (each sync hidden
behind compute, replicas never waiting) and pipetrain's ``pipedream`` schedule (every round of a
replicated stage waits for its sync) part ways. For each configuration (``--configs``, default 3-1
and 2-1-1) the cut is the one §3.2 prices fastest for that pattern of replicas. Per configuration:

* §3.2: :func:`pipetrain.planning.partition.price_stages`, the partitioner's model of the plan (syncs
  hidden), and the same with each sync added to its stage's compute (``sync_overlaps=False``, the
  partitioner's second model);
* simulated: :func:`pipetrain.predict.pipeline.simulate_steady` of the plan under ``pipedream`` from the
  layer profile and the run set-up measured on the same hosts
  (:func:`pipetrain.bench.predictions.profile_with_setup`), at the link's measured TCP payload rate: how
  ``stages="auto"`` prices a plan;
* measured: ``pipetrain.train`` of the plan under ``pipedream``
  (:func:`pipetrain.bench.pipetrain_jobs.pipetrain_job`), the median samples/s of its timed windows
  (whole rounds of every stage's replicas); the median over ``--repeats`` runs, configurations
  interleaved.

Every prediction's error is predicted / measured - 1. Four workers share this machine's cores; the
set-up's measured slowdown is how the predictions know it. Results: BENCHMARKS.md, "Replicated plans".
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pipetrain.bench import cluster
from pipetrain.bench.measure import summarize
from pipetrain.bench.pipetrain_jobs import pipetrain_job
from pipetrain.bench.predictions import profile_with_setup
from pipetrain.bench.systems import SuiteConfig
from pipetrain.planning import Plan
from pipetrain.planning.partition import price_stages
from pipetrain.predict.pipeline import simulate_steady
from pipetrain.profiling import Profile
from pipetrain.runtime.launch import spawn
from pipetrain.simulate import Link
from pipetrain.trace import seconds_by_kind


def best_cut(profile: Profile, replicas: list[int], bandwidth: float) -> Plan:
    """The plan of ``replicas`` (workers per stage) whose cut §3.2 prices fastest, every cut tried."""
    cuts = itertools.combinations(range(1, len(profile)), len(replicas) - 1)
    plans = [price_stages(profile, [0, *c], replicas, bandwidth) for c in cuts]
    return min(plans, key=lambda p: p.stage_time_s)


def predictions(profile: Profile, chosen: Plan, bandwidth: float, batch: int) -> dict[str, Any]:
    """Samples/s of ``chosen`` by §3.2, by §3.2 with syncs added, and by the simulator, with the
    simulator's seconds per minibatch in each action kind per worker (as the runs' ``breakdown``)."""
    added = price_stages(profile, chosen.boundaries, chosen.replicas, bandwidth, sync_overlaps=False)
    sim = simulate_steady(profile, chosen, Link(bandwidth), batch)
    done = sum(1 for text, _, _ in sim.trace[-1] if text.startswith("U"))  # minibatches: the output worker's steps
    return {"paper": batch / chosen.stage_time_s, "paper_sync_added": batch / added.stage_time_s,
            "simulated": sim.samples_per_s or 0.0,
            "simulated_breakdown": [{k: v / done for k, v in seconds_by_kind(t).items()} for t in sim.trace]}


def with_run_times(profile: Profile, chosen: Plan, breakdowns: list[list[dict[str, float]]]) -> Profile:
    """``profile`` with each stage's layers scaled to the forward, backward and optimizer seconds its
    workers took in the runs (``breakdowns``: per run, per rank, seconds per minibatch of the job, so a
    replica's own minibatch takes its figure times the stage's replicas), and a set-up whose compute runs
    unslowed and without jitter, whose message end costs the compute thread what a send took: the
    simulator fed the runs' own action times, a check of its rules (replicas, syncs, links) apart from
    its inputs."""
    assert profile.setup is not None
    ends = [*chosen.boundaries[1:], len(profile)]
    layers = list(profile.layers)
    rank, sends = 0, []
    for first, end, r in zip(chosen.boundaries, ends, chosen.replicas):
        ranks = range(rank, rank + r)
        rank += r

        def real(kind: str) -> float:
            return statistics.mean(run[w].get(kind, 0.0) * r for run in breakdowns for w in ranks)
        sends += [run[w][k] * r for run in breakdowns for w in ranks for k in ("SF", "SB") if k in run[w]]
        own = layers[first:end]
        f = real("F") / max(sum(x.forward_s for x in own), 1e-12)
        b = real("B") / max(sum(x.backward_s for x in own), 1e-12)
        u = real("U") / max(sum(x.optimizer_s for x in own), 1e-12)
        layers[first:end] = [replace(x, forward_s=x.forward_s * f, backward_s=x.backward_s * b,
                                     weight_backward_s=None if x.weight_backward_s is None else x.weight_backward_s * b,
                                     optimizer_s=x.optimizer_s * u) for x in own]
    setup = replace(profile.setup, slowdown=1.0, jitter_s=0.0, computing_message_cpu_s=statistics.mean(sends or [0.0]),
                    computing_message_cpu_s_per_byte=0.0)
    return replace(profile, layers=layers, setup=setup)


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    cfg = SuiteConfig(model="mnist-mlp", model_kwargs={"hidden": (args.hidden,) * 3}, workers=4, link=args.link,
                      batch_size=args.batch_size, warmup=args.warmup, windows=args.windows,
                      steps_per_window=args.steps_per_window, threads=1, timeout_s=120.0)
    peer = cfg.peer()
    configs = [[int(r) for r in c.split("-")] for c in args.configs.split(",")]
    if any(sum(c) != cfg.workers for c in configs):
        raise SystemExit(f"--configs {args.configs}: every configuration places {cfg.workers} workers")
    reason = "--loopback given" if args.loopback else cluster.unavailable_reason()
    if reason:
        log(f"{reason}; running on loopback")
        return measure(cfg, peer, configs, args, lambda fn, a, world: spawn(fn, world, a, timeout=600), None, log)
    with cluster.EmulatedCluster(cfg.workers, link=cfg.link) as hosts:
        ports = iter(range(29600, 30600))
        link_bps = cluster.socket_throughput(hosts, 0, 1, seconds=2.0)["bits_per_s"]
        log(f"host 0 -> host 1 socket throughput: {link_bps / 1e6:.0f} Mbit/s")
        return measure(cfg, peer, configs, args,
                       lambda fn, a, world: hosts.spawn(fn, a, world=world, port=next(ports), timeout=600),
                       link_bps / 8, log)


def measure(cfg: SuiteConfig, peer: Any, configs: list[list[int]], args: argparse.Namespace,
            launch: Callable[..., list[Any]], bandwidth: float | None, log: Callable[[str], None]) -> dict[str, Any]:
    """Profile and set-up, the predictions, then the runs, configurations interleaved."""
    profile = profile_with_setup(cfg, peer, launch, cfg.batch_size, ring_cpu=False)
    assert profile.setup is not None
    log(f"set-up: {profile.setup.describe()}")
    bw = bandwidth or 1e15  # loopback: the measured transport is the link
    plans = [best_cut(profile, c, bw) for c in configs]
    rows = {p.config: {"stages": p.boundaries, "replicas": p.replicas, **predictions(profile, p, bw, cfg.batch_size),
                       "runs": [], "breakdowns": []} for p in plans}
    for rep in range(args.repeats):
        for p in plans:
            t0 = time.perf_counter()
            found = summarize(launch(pipetrain_job, (peer, p.config, {"schedule": "pipedream", "stages": p}, True),
                                     cfg.workers))
            rows[p.config]["runs"].append(found["samples_per_s"])
            rows[p.config]["breakdowns"].append(found["breakdown"])
            log(f"run {rep + 1}: {p.config} {found['samples_per_s']:.1f} samples/s ({time.perf_counter() - t0:.0f} s)")
    for p in plans:
        row = rows[p.config]
        row["measured"] = statistics.median(row["runs"])
        fed = with_run_times(profile, p, row["breakdowns"])
        row["simulated_run_times"] = simulate_steady(fed, p, Link(bw), cfg.batch_size).samples_per_s or 0.0
        row["errors"] = {k: row[k] / row["measured"] - 1 for k in KINDS}
    return {"link": cfg.link, "link_bytes_per_s": bandwidth, "model": f"mnist-mlp hidden {args.hidden} x 3",
            "batch_size": cfg.batch_size, "setup": profile.setup.describe(), "profile": profile.to_dict(), "configs": rows,
            "date": time.strftime("%Y-%m-%d")}


KINDS = ("paper", "paper_sync_added", "simulated", "simulated_run_times")
"""The predictions, in the table's order."""


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table: samples/s predicted and measured, each error beside."""
    lines = ["| plan (first layers) | §3.2 | §3.2, sync added | simulated | simulated, the runs' action times | "
             "measured (runs) |", "|---|---|---|---|---|---|"]
    for config, r in report["configs"].items():
        runs = ", ".join(f"{x:.0f}" for x in r["runs"])
        cells = " | ".join(f"{r[k]:.0f} ({r['errors'][k]:+.0%})" for k in KINDS)
        lines.append(f"| {config} ({','.join(map(str, r['stages']))}) | {cells} | {r['measured']:.0f} ({runs}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="1gbit", help="each emulated host's link (default 1gbit)")
    p.add_argument("--hidden", type=int, default=1024, help="width of each of the three hidden layers")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--configs", default="3-1,2-1-1", help="replicas per stage, comma-separated plans of 4 workers")
    p.add_argument("--repeats", type=int, default=3, help="runs per plan (default 3)")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--steps-per-window", type=int, default=6, help="a multiple of every stage's replicas")
    p.add_argument("--loopback", action="store_true", help="local processes, no emulated cluster")
    p.add_argument("--smoke", action="store_true", help="a tiny model on loopback, 1 run: the script end to end")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.batch_size, args.repeats, args.loopback = 32, 16, 1, True
        args.warmup, args.windows = 2, 2
    if any(args.steps_per_window % math.lcm(*map(int, c.split("-"))) for c in args.configs.split(",")):
        raise SystemExit(f"--steps-per-window {args.steps_per_window} must be a multiple of every stage's replicas")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
    report = run(args, log)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
