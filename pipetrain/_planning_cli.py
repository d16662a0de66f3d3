"""``pipetrain profile`` and ``pipetrain plan``: parse, call the API, print."""
from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import default_collate

from pipetrain.cli import _call_factory, _loss
from pipetrain.planning import Plan, plan
from pipetrain.planning.units import format_bandwidth
from pipetrain.profiling import Profile, profile_model


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``profile`` and ``plan`` subcommands."""
    p = sub.add_parser("profile", help="measure each layer's seconds and bytes on one minibatch")
    p.add_argument("model", help="MODULE:FACTORY returning the nn.Module (or the module itself)")
    p.add_argument("--batch-size", type=int, required=True)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--input-shape", help="one sample's shape, e.g. 1,8,8 (random float32 input)")
    given.add_argument("--data", help="MODULE:FACTORY returning a dataset of (input, target); "
                                      "its first batch-size items are used")
    p.add_argument("--loss", default="cross_entropy", help="with --data: torch.nn.functional name or MODULE:FUNCTION")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per layer (the median is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per layer first")
    p.add_argument("-o", "--output", default="profile.json")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="partition a profiled model over workers (PipeDream's optimizer)")
    p.add_argument("profile", help="profile JSON (`pipetrain profile`) or a PipeDream graph.txt")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--bandwidth", default="10Gbit", help="between workers (servers), e.g. 10Gbit, 1.25GB/s")
    p.add_argument("--straight", action="store_true", help="one worker per stage, no replication")
    p.add_argument("--memory", help="per worker, e.g. 16GiB: weights, stashed versions and activations must fit")
    p.add_argument("--workers-per-server", type=int, help="two-level topology: workers in one server")
    p.add_argument("--intra-bandwidth", help="with --workers-per-server: bandwidth inside a server")
    p.add_argument("--fewer-workers", action="store_true", help="use fewer workers when more would not help")
    p.add_argument("--allreduce", choices=("ps", "ring"), default="ps",
                   help="weight sync volume: parameter server (the paper's) or ring allreduce")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.set_defaults(func=cmd_plan)


def cmd_profile(args: argparse.Namespace) -> None:
    model = _call_factory(args.model)
    if args.input_shape:
        shape = [int(x) for x in args.input_shape.replace("x", ",").split(",") if x.strip()]
        batch, loss_fn = torch.randn(args.batch_size, *shape), None
    else:
        dataset = _call_factory(args.data)
        if len(dataset) < args.batch_size:
            raise ValueError(f"{args.data} has {len(dataset)} items, fewer than --batch-size {args.batch_size}")
        batch, loss_fn = default_collate([dataset[i] for i in range(args.batch_size)]), _loss(args.loss)
    profile = profile_model(model, batch, loss_fn, repeats=args.repeats, warmup=args.warmup)
    profile.save(args.output)
    forward = sum(x.forward_s for x in profile.layers)
    backward = sum(x.backward_s for x in profile.layers)
    print(f"profiled {len(profile)} layers of {profile.model} at batch {profile.batch_size} on {profile.device}: "
          f"{forward:.4g} s forward, {backward:.4g} s backward per minibatch")
    print(f"wrote {args.output}")


def cmd_plan(args: argparse.Namespace) -> None:
    profile = Profile.load(args.profile)
    result = plan(profile, args.workers, args.bandwidth, straight=args.straight, memory=args.memory,
                  workers_per_server=args.workers_per_server, intra_bandwidth=args.intra_bandwidth,
                  fewer_workers=args.fewer_workers, allreduce=args.allreduce, source=args.profile)
    if args.output:
        result.save(args.output)
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print(describe(result, profile))
    if args.output:
        print(f"wrote {args.output}")


def describe(result: Plan, profile: Profile) -> str:
    """The plan for people: notation, stages, NOAM, predicted time and speedups."""
    o = result.options
    where = f"{o['workers']} workers at {format_bandwidth(o['bandwidth'])}"
    if o.get("workers_per_server"):
        where += f" between servers of {o['workers_per_server']} ({format_bandwidth(o['intra_bandwidth'])} inside)"
    sync = "parameter-server" if o.get("allreduce", "ps") == "ps" else "ring-allreduce"
    lines = [f"{o.get('profile', 'profile')}: {len(profile)} layers on {where}, {sync} weight sync",
             f"config {result.config}: {len(result.stages)} stage{'s' * (len(result.stages) > 1)}, "
             f"{result.workers} workers, NOAM {result.noam}"]
    lines.append("  stage  layers    replicas  stage s    boundary s  first .. last layer")
    for k, s in enumerate(result.stages):
        first, last = profile.layers[s.first_layer].name, profile.layers[s.last_layer].name
        send = f"{s.boundary_s:10.4g}" if k < len(result.stages) - 1 else f"{'-':>10}"
        lines.append(f"  {k:>5}  {f'{s.first_layer}-{s.last_layer}':<9} {s.replicas:>8}  {s.time_s:<9.4g}  {send}  "
                     f"{_short(first)} .. {_short(last)}")
    lines.append(f"predicted time per minibatch: {result.stage_time_s:.4g} s (the slowest stage or boundary)")
    lines.append(f"predicted speedup: {result.speedup_vs_one:.2f}x over one worker, "
                 f"{result.speedup_vs_dp:.2f}x over data parallelism on {o['workers']} workers")
    return "\n".join(lines)


def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."
