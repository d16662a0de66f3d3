"""``python -m pipetrain.bench``: run peer runners on an emulated cluster (or loopback); print JSON lines.

Example, the vgg-like comparison on two hosts with 1 Gbit/s links::

    python -m pipetrain.bench --runners ddp,torch-1f1b --model vgg-like --hosts 2 --link 1gbit \\
        --stages 0,12 --microbatches 4 --batch-size 32
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from pipetrain.bench.cluster import EmulatedCluster, socket_throughput, unavailable_reason
from pipetrain.bench.peers import PeerConfig, ddp, summarize, torch_pipeline
from pipetrain.runtime.launch import spawn

RUNNERS = ("ddp", "ddp-fp16", "torch-1f1b", "torch-gpipe")


def _job(name: str, cfg: PeerConfig, args: argparse.Namespace) -> tuple[Any, tuple]:
    if name.startswith("ddp"):
        return ddp, (cfg, name == "ddp-fp16")
    return torch_pipeline, (cfg, args.stages, args.microbatches, name.removeprefix("torch-"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipetrain.bench", description=__doc__.splitlines()[0])
    p.add_argument("--runners", default="ddp,torch-1f1b", help=f"comma-separated, of {', '.join(RUNNERS)}")
    p.add_argument("--model", default="vgg-like")
    p.add_argument("--hosts", type=int, default=2, help="workers: one per host")
    p.add_argument("--link", default="1gbit", help="each host's rate, in tc units")
    p.add_argument("--loopback", action="store_true", help="no emulated cluster: local processes on 127.0.0.1")
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="first layer of each pipeline stage, e.g. 0,12 (default: an even split)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--steps-per-window", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--iperf", action="store_true", help="also measure host 0 -> host 1 socket throughput")
    args = p.parse_args(argv)
    names = args.runners.split(",")
    if bad := [n for n in names if n not in RUNNERS]:
        p.error(f"unknown runner(s) {bad}; choose from {RUNNERS}")
    cfg = PeerConfig(model=args.model, batch_size=args.batch_size, warmup=args.warmup, windows=args.windows,
                     steps_per_window=args.steps_per_window, threads=args.threads)
    if args.stages is None:
        from pipetrain.layers import LayeredModel
        n = len(LayeredModel(cfg.build()))
        args.stages = [i * n // args.hosts for i in range(args.hosts)]
    reason = None if args.loopback else unavailable_reason()
    if reason:
        print(json.dumps({"note": f"{reason}; running on loopback"}))
    if args.loopback or reason:
        for name in names:
            fn, fargs = _job(name, cfg, args)
            print(json.dumps({"where": "loopback", **summarize(spawn(fn, args.hosts, fargs))}), flush=True)
        return
    with EmulatedCluster(args.hosts, link=args.link) as c:
        where = f"{args.hosts} namespaces, {args.link}"
        if args.iperf:
            print(json.dumps({"where": where, "socket_throughput": socket_throughput(c, 0, 1)}), flush=True)
        for name in names:
            fn, fargs = _job(name, cfg, args)
            print(json.dumps({"where": where, **summarize(c.spawn(fn, fargs))}), flush=True)


if __name__ == "__main__":
    main()
