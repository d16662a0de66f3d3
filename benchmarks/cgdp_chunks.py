"""CGDP per chunk size: sync overhead measured and predicted, and where the run-time search lands.

    flock /tmp/pipetrain-bench.lock python benchmarks/cgdp_chunks.py [--model vgg-like] [--workers 2] [--json F]

On one machine (local worker processes, gloo, one torch thread each), for one zoo model at one
minibatch (the samples of one update of the whole job; each worker takes batch / workers):

* ``alone``: one worker's forward + backward + SGD step on its shard, in this process (median);
* ``alone x M``: M processes each training on its shard with no synchronisation at all, at once: the
  same work as a data-parallel worker with the machine's cores shared, but no sync;
* ``ddp`` (PyTorch DistributedDataParallel), ``cgdp`` at every fixed chunk size from 1 to one chunk
  for all layers, and ``cgdp`` with ``chunk="auto"`` timed after its search (``pipetrain.bench.measure``
  timing: median of windows after warm-up).

Runs on a shared machine vary by up to 30% from one process to the next, so every system runs ``--rounds``
times in rotating order and the median is kept.

Per-iteration sync overhead = iteration time - ``alone``, and beside it the
part that is not CPU contention: iteration time - ``alone x M``. The cost model's prediction for each
chunk (``pipetrain.predict.predict_cgdp``, CGDP eq. 1-2) uses a profile of one shard taken here, the
SGD step measured here, host copy and sum rates measured here (``measure_host_costs``) and the latency
of one 1-float allreduce between the workers, measured on loopback.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.bench.measure import PeerConfig, summarize
from pipetrain.bench.pipetrain_jobs import pipetrain_job
from pipetrain.bench.stages import stage_times
from pipetrain.bench.torch_peers import ddp, no_sync
from pipetrain.profiling import profile_model
from pipetrain.runtime.launch import keep_freed_memory, spawn
from pipetrain.predict import predict_cgdp
from pipetrain.strategies.cgdp import layer_parameters, measure_host_costs


def signal_latency(repeats: int = 200) -> float:
    """Median seconds of a 1-float gloo allreduce between this rank and the others."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    flag, times = torch.zeros(1), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dist.all_reduce(flag)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return statistics.median(times[10:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vgg-like")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--steps-per-window", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="runs of every system, in rotating order (median kept)")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args(argv)
    keep_freed_memory()  # as the workers run
    cfg = PeerConfig(model=args.model, batch_size=args.batch_size, warmup=3, windows=args.windows,
                     steps_per_window=args.steps_per_window, timeout_s=120)
    shard = PeerConfig(model=args.model, batch_size=args.batch_size // args.workers)
    layers = len(layer_parameters(cfg.build()))
    t_all = time.perf_counter()
    alone = stage_times(shard, [0], repeats=10)[0]
    compute_s = alone["forward_backward_s"] + alone["update_s"]
    print(f"# {args.model}, {args.workers} workers on one machine, batch {args.batch_size}; {layers} layers with "
          f"parameters; load {os.getloadavg()[0]:.2f}", flush=True)
    jobs: dict[str, tuple[Any, tuple]] = {"alone x M": (no_sync, (cfg,)), "ddp": (ddp, (cfg,))}
    jobs.update({f"cgdp {k}": (pipetrain_job, (cfg, "cgdp", {"strategy": "cgdp", "chunk": k})) for k in range(1, layers + 2)})
    jobs["cgdp auto"] = (pipetrain_job, (cfg, "cgdp", {"strategy": "cgdp", "chunk": "auto"}))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    names = list(jobs)
    for r in range(args.rounds):  # every round in another order, so no system always runs first or last
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, fn_args = jobs[name]
            s = summarize(spawn(fn, args.workers, fn_args))
            runs[name].append(s)
            print(f"round {r} {name:<12} {s['samples_per_s']:8.1f} samples/s", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for name, done in runs.items():
        rate = statistics.median(x["samples_per_s"] for x in done)
        rows[name] = {"samples_per_s": rate, "rounds": [x["samples_per_s"] for x in done],
                      "iteration_s": args.batch_size / rate, "overhead_s": args.batch_size / rate - compute_s,
                      "searched": [x["search"]["best"] if x.get("search") else None for x in done],
                      "search_iterations": [x["search"]["iterations"] if x.get("search") else None for x in done]}
    together, auto = rows["alone x M"], rows["cgdp auto"]
    latency = statistics.median(spawn(signal_latency, args.workers, ()))
    torch.set_num_threads(1)
    x, y = cfg.spec.dataset(args.batch_size // args.workers, seed=cfg.seed + 1)[:]
    profile = profile_model(cfg.build(), (x, y), cfg.spec.loss_fn, repeats=5, warmup=2)
    host = measure_host_costs(sum(p.numel() for p in cfg.build().parameters()), args.workers)
    fixed = {k: rows[f"cgdp {k}"] for k in range(1, layers + 2)}
    for k, row in fixed.items():
        pred = predict_cgdp(profile, args.workers, k, batch_size=args.batch_size, update_s=alone["update_s"],
                            signal_s=latency, cores_per_worker=(os.cpu_count() or 1) / args.workers, **host)
        row["predicted_overhead_s"] = pred.overhead_s
        row["predicted_iteration_s"] = pred.iteration_s
    best = min(fixed, key=lambda k: fixed[k]["iteration_s"])
    summary = {"model": args.model, "workers": args.workers, "batch_size": args.batch_size, "layers": layers,
               "alone_s": compute_s, "alone_forward_backward_s": alone["forward_backward_s"],
               "alone_update_s": alone["update_s"], "together_s": together["iteration_s"],
               "signal_latency_s": latency, **host, "rows": rows, "best_fixed_chunk": best,
               "searched_chunks": auto["searched"], "search_iterations": auto["search_iterations"],
               "auto_vs_best_fixed": auto["iteration_s"] / fixed[best]["iteration_s"] - 1,
               "cgdp_auto_vs_ddp": auto["samples_per_s"] / rows["ddp"]["samples_per_s"],
               "wall_s": time.perf_counter() - t_all}
    print()
    print(f"alone: {compute_s * 1e3:.1f} ms (forward+backward {alone['forward_backward_s'] * 1e3:.1f}, step "
          f"{alone['update_s'] * 1e3:.1f}); {args.workers} alone at once: {together['iteration_s'] * 1e3:.1f} ms; "
          f"signal {latency * 1e6:.0f} us; host copy {host['copy_s_per_byte'] * 1e12:.1f} ps/B, sum "
          f"{host['sum_s_per_byte'] * 1e12:.1f} ps/B")
    print(f"| system | samples/s (median of {args.rounds}) | rounds | iteration (ms) | overhead vs alone (ms) | "
          "vs alone x M (ms) | predicted overhead (ms) |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        pred = f"{row['predicted_overhead_s'] * 1e3:.1f}" if "predicted_overhead_s" in row else "-"
        print(f"| {name} | {row['samples_per_s']:.1f} | {', '.join(f'{x:.0f}' for x in row['rounds'])} "
              f"| {row['iteration_s'] * 1e3:.1f} | {row['overhead_s'] * 1e3:.1f} "
              f"| {(row['iteration_s'] - together['iteration_s']) * 1e3:.1f} | {pred} |")
    print(f"best fixed chunk {best}; the search chose {auto['searched']} after {auto['search_iterations']} iterations; "
          f"cgdp auto {summary['auto_vs_best_fixed']:+.1%} against the best fixed chunk; cgdp auto "
          f"{summary['cgdp_auto_vs_ddp']:.2f}x ddp; {summary['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
