"""``pipetrain profile``, ``pipetrain plan`` and ``pipetrain simulate``: parse, call the API, print."""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import replace
from typing import Any

import torch

from pipetrain.cli.common import (
    add_optimizer_options, call_factory, chunk_option, load_loss, optimizer_of, parse_stages,
)
from pipetrain.errors import one_line
from pipetrain.layers import split_points
from pipetrain.planning import Plan, check_fits, parse_bandwidth
from pipetrain.planning.choose import CANDIDATES, choose_strategy
from pipetrain.planning.schedules import choose_schedule
from pipetrain.planning.units import format_bandwidth
from pipetrain.predict.pipeline import best_plan, propose, steady_rate, window_minibatches
from pipetrain.profiling import Profile, profile_model, time_batching
from pipetrain.registry import DEFAULT_SCHEDULE, SCHEDULES, Auto, Strategy, as_strategy, make, schedule_of
from pipetrain.setup import measure_setup, model_step
from pipetrain.timing import torch_threads
from pipetrain.batches import collate_parts
from pipetrain.simulate import Link, simulate
from pipetrain.trace import draw_timeline, write_chrome_trace


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``profile``, ``plan`` and ``simulate`` subcommands."""
    p = sub.add_parser("profile", help="measure each layer's seconds and bytes on one minibatch")
    p.add_argument("model", help="MODULE:FACTORY returning the nn.Module (or the module itself)")
    p.add_argument("--batch-size", type=int, required=True, help="samples in the profiled minibatch")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--input-shape", help="one sample's shape, e.g. 1,8,8 (random input of the dtype of the "
                                               "model's first floating parameter)")
    given.add_argument("--data", help="MODULE:FACTORY returning a dataset of (input, target); "
                                      "its first batch-size items are used")
    p.add_argument("--loss", default="cross_entropy", help="with --data: torch.nn.functional name or MODULE:FUNCTION")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per layer (the median is kept)")
    p.add_argument("--compile", action="store_true",
                   help="time each layer through torch.compile, as train --compile runs it (compilation timed apart)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per layer first")
    add_optimizer_options(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads, as each worker will have "
                                                              "(default: cores / --setup workers, or all)")
    p.add_argument("--setup", type=int, default=None, metavar="WORKERS",
                   help="also measure how WORKERS local workers run here (contention, per-message cost), "
                        "for predictions of this machine")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile (default profile.json)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="partition a profiled model over workers (PipeDream's optimizer)")
    p.add_argument("profile", help="profile JSON (`pipetrain profile`) or a PipeDream graph.txt")
    p.add_argument("--workers", type=int, required=True, help="workers to plan for")
    p.add_argument("--bandwidth", default="10Gbit", help="between workers (servers), e.g. 10Gbit, 1.25GB/s "
                                                         "(default 10Gbit)")
    p.add_argument("--straight", action="store_true", help="one worker per stage, no replication")
    p.add_argument("--memory", help="per worker, e.g. 16GiB: weights, stashed versions, activations, gradients, "
                                    "optimizer state (and the profile's process baseline) must fit")
    p.add_argument("--recompute", action="store_true",
                   help="with --memory: the run recomputes activations (train --recompute): stages keep inputs only")
    p.add_argument("--workers-per-server", type=int, help="two-level topology: workers in one server")
    p.add_argument("--intra-bandwidth", help="with --workers-per-server: bandwidth inside a server")
    p.add_argument("--fewer-workers", action="store_true", help="use fewer workers when more would not help")
    p.add_argument("--allreduce", choices=("ps", "ring"), default="ps",
                   help="weight sync volume: parameter server (the paper's) or ring allreduce")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--strategies", default=None,
                   help="'all' or some of " + ", ".join(CANDIDATES) + ": predict each strategy's samples/s and "
                        "pick the fastest (strategy='auto') instead of printing the pipeline plan")
    p.add_argument("--schedules", default=None,
                   help="'all' or some of " + ", ".join(SCHEDULES) + ": simulate each schedule at each microbatch "
                        "count for the plan, with --memory as the limit, and pick the fastest (schedule='auto')")
    p.add_argument("--allow-compression", action="store_true", help="--strategies: may pick trunc16 or quant8")
    p.add_argument("--one-machine", action="store_true", help="--strategies: the workers share one machine (cgdp "
                                                              "competes), linked at --bandwidth")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per minibatch, for samples/s (default: the profile's; a PipeDream graph.txt "
                        "records none)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="predict a pipeline's or a data-parallel strategy's throughput from a profile")
    p.add_argument("profile", help="profile JSON (`pipetrain profile`) or a PipeDream graph.txt")
    p.add_argument("--strategy", default="pipeline", help="pipeline (default), ddp, pipe-sgd or cgdp")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--workers", type=int, help="pipeline: plan for this many workers with the partitioner; "
                                                   "data parallel: the workers")
    where.add_argument("--plan", help="a plan JSON from `pipetrain plan`")
    where.add_argument("--stages", help="first layer index of each stage (one worker each), e.g. 0,3,7")
    p.add_argument("--straight", action="store_true", help="with --workers: one worker per stage")
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, help=f"pipeline: {' | '.join(SCHEDULES)} (default "
                                                                   f"{DEFAULT_SCHEDULE})")
    p.add_argument("--looped", type=int, default=None,
                   help="interleaved-1f1b: the W workers the --stages go to round robin (stage s on s mod W)")
    p.add_argument("--minibatches", type=int, default=None,
                   help="minibatches to simulate, any count (a replicated stage's partial last round updates unsynced); "
                        "default: a steady-state window, its rate measured in the middle (docs/simulator.md)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="gpipe / 1f1b-flush / zero-bubble / interleaved-1f1b / 2bw: slices per minibatch (default 1)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the profile's")
    p.add_argument("--bandwidth", default="10Gbit", help="per link direction, e.g. 10Gbit, 1.25GB/s (default 10Gbit)")
    p.add_argument("--latency", type=float, default=0.0, help="seconds per transfer (per message)")
    p.add_argument("--staleness", type=int, default=None, help="pipe-sgd: K (default 2)")
    p.add_argument("--compression", default=None, help="pipe-sgd: none | trunc16 | quant8")
    p.add_argument("--update-s", type=float, default=None,
                   help="seconds per optimizer step (default: the profile's optimizer seconds, 0 where not measured)")
    p.add_argument("--chunk", type=chunk_option, default=None,
                   help="cgdp: layers per chunk, or auto (default: the size its cost model predicts fastest)")
    p.add_argument("--sync-latency", type=float, default=1e-4,
                   help="cgdp: seconds of one signal among a machine's workers (default 1e-4, a 1-float gloo "
                        "allreduce on loopback); host copy and sum rates are measured here")
    p.add_argument("--png", help="write the timeline picture here")
    p.add_argument("--trace-json", help="write a Chrome trace here (open in ui.perfetto.dev)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_simulate)


def _know_batch_size(args: argparse.Namespace, profile: Profile) -> None:
    """One line where samples/s cannot be priced: neither ``--batch-size`` nor the profile gives a batch size."""
    if not (args.batch_size or profile.batch_size):
        raise ValueError(f"{args.profile} does not record its batch size (as PipeDream's graph.txt files do not), "
                         "so samples/s are unknown; give it with --batch-size B")


def _at_least(args: argparse.Namespace, **minimum: float) -> None:
    """One line for the first option given below its minimum, before anything is loaded or run."""
    for name, low in minimum.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def _shape(text: str) -> list[int]:
    """``--input-shape``: ``1,8,8`` or ``1x8x8``, each dimension a positive integer."""
    dims = [d.strip() for d in re.split(r"[,x]", text)]
    if not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"--input-shape {text!r}: give one sample's dimensions as positive integers, "
                         "e.g. 1,8,8 or 1x8x8")
    return [int(d) for d in dims]


def _input_dtype(model: torch.nn.Module) -> torch.dtype:
    """``--input-shape``'s random input takes the dtype of the model's first floating parameter (the
    default dtype without one), since a float64 model refuses float32 input."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def cmd_profile(args: argparse.Namespace) -> None:
    _at_least(args, batch_size=1, repeats=1, warmup=0, setup=1, threads=1)
    shape = _shape(args.input_shape) if args.input_shape else None
    model = call_factory(args.model, "model")
    if shape:
        batch: Any = torch.randn(args.batch_size, *shape, dtype=_input_dtype(model))
        loss_fn = None
    else:
        dataset = call_factory(args.data, "data")
        if len(dataset) < args.batch_size:
            raise ValueError(f"{args.data} has {len(dataset)} items, fewer than --batch-size {args.batch_size}")
        batch, loss_fn = collate_parts(dataset, range(args.batch_size), (0, 1)), load_loss(args.loss)
    threads = args.threads or max(1, (os.cpu_count() or 1) // (args.setup or 1))
    with torch_threads(threads):
        try:
            profile = profile_model(model, batch, loss_fn, optimizer=optimizer_of(args), repeats=args.repeats,
                                    warmup=args.warmup, compile=args.compile)
        except RuntimeError as e:
            if not shape:
                raise
            raise ValueError(f"{args.model} does not run on random {batch.dtype} input of shape "
                             f"{list(batch.shape)} ({one_line(e)}); give real samples with --data MODULE:FACTORY"
                             ) from None
        if not shape:
            profile.inputs_s, profile.targets_s, profile.both_s = time_batching(dataset, args.batch_size)
    if args.setup:
        kernel = model_step(model, tuple(batch), loss_fn) if loss_fn is not None else None
        profile.setup = measure_setup(args.setup, threads, kernel, ring_bytes=profile.parameter_bytes)
        print(f"set-up: {profile.setup.describe()}")
    profile.save(args.output)
    print("  layer  forward ms  backward ms  output KB  name (submodule:operator)")
    for k, layer in enumerate(profile.layers):
        print(f"  {k:>5}  {layer.forward_s * 1e3:>10.3f}  {layer.backward_s * 1e3:>11.3f}  "
              f"{layer.activation_bytes / 1024:>9.1f}  {layer.name}")
    forward = sum(x.forward_s for x in profile.layers)
    backward = sum(x.backward_s for x in profile.layers)
    print(f"profiled {len(profile)} layers of {profile.model} at batch {profile.batch_size} on {profile.device}: "
          f"{forward:.4g} s forward, {backward:.4g} s backward per minibatch"
          + (f" (compiled; compiling took {profile.meta['compile_s']:.1f} s, not counted)" if args.compile else ""))
    if profile.inputs_s or profile.targets_s:
        print(f"building a minibatch from {args.data}: {profile.inputs_s * 1e3:.3f} ms its inputs, "
              f"{profile.targets_s * 1e3:.3f} ms its targets, {profile.both_s * 1e3:.3f} ms both at once")
    print(f"wrote {args.output}")


def cmd_plan(args: argparse.Namespace) -> None:
    _at_least(args, workers=1, workers_per_server=1, batch_size=1)
    if args.strategies is not None and args.schedules is not None:
        raise ValueError("--strategies and --schedules each pick one thing; give one of them")
    profile = Profile.load(args.profile)
    if args.strategies is not None:
        return _choose(args, profile)
    if args.schedules is not None:
        return _schedules(args, profile)
    result = propose(profile, args.workers, args.bandwidth, straight=args.straight, memory=args.memory,
                     workers_per_server=args.workers_per_server, intra_bandwidth=args.intra_bandwidth,
                     fewer_workers=args.fewer_workers, allreduce=args.allreduce, source=args.profile,
                     recompute=args.recompute)
    result = best_plan(profile, result, Link(parse_bandwidth(args.bandwidth)), args.batch_size)
    if args.output:
        result.save(args.output)
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print(describe(result, profile))
    if args.output:
        print(f"wrote {args.output}")


def _choose(args: argparse.Namespace, profile: Profile) -> None:
    """``plan --strategies``: every strategy's prediction, the table and the choice."""
    if args.output or args.straight or args.memory or args.workers_per_server or args.fewer_workers:
        raise ValueError("--strategies predicts and picks a strategy; drop -o, --straight, --memory, "
                         "--workers-per-server and --fewer-workers (plan the pipeline alone without --strategies)")
    _know_batch_size(args, profile)
    choice = choose_strategy(profile, args.workers, args.bandwidth, batch_size=args.batch_size,
                             one_machine=args.one_machine, allow_compression=args.allow_compression,
                             strategies=_names(args.strategies))
    _show(choice, args.json)
    if not args.json:
        print(f"samples/s: {_counts(profile)}")


def _names(text: str) -> list[str] | None:
    """``all`` -> None (every one), else the comma-separated names."""
    return None if text == "all" else [n.strip() for n in text.split(",") if n.strip()]


def _show(choice: Any, as_json: bool) -> None:
    """A choice (strategies' or schedules') as one JSON object, or its table and reason."""
    if as_json:
        print(json.dumps(choice.to_dict()))
    else:
        print(choice.table())
        print(choice.reason)


def _schedules(args: argparse.Namespace, profile: Profile) -> None:
    """``plan --schedules``: every schedule priced for the plan, the table and the choice."""
    if args.straight or args.workers_per_server or args.fewer_workers or args.allow_compression or args.one_machine:
        raise ValueError("--schedules plans each schedule's stages itself; drop --straight, --workers-per-server, "
                         "--fewer-workers, --allow-compression and --one-machine")
    _know_batch_size(args, profile)
    choice = choose_schedule(profile, args.workers, args.bandwidth, args.batch_size, memory=args.memory,
                             schedules=_names(args.schedules), recompute=True if args.recompute else None)
    if args.output:
        choice.plan.save(args.output)
    _show(choice, args.json)
    if not args.json:
        print(f"samples/s: each row a short epoch, filled and drained, as a run measures it (`plan` alone and "
              f"`simulate` print the steady rate); {_counts(profile)}")
    if args.output and not args.json:
        c = choice.chosen
        print(f"wrote {args.output} (run it with --schedule {c.schedule}"
              + (f" --microbatches {c.microbatches}" if c.microbatches > 1 else "")
              + (" --recompute" if c.recompute else "") + ")")


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
    model = "syncs hidden behind compute" if o.get("sync_overlaps", True) else "each sync added to its stage's compute"
    lines.append(f"partitioner's model (PipeDream §3.2, {model}): {result.stage_time_s:.4g} s per "
                 f"minibatch at the slowest stage or boundary, {result.speedup_vs_one:.2f}x one worker, "
                 f"{result.speedup_vs_dp:.2f}x data parallelism on {o['workers']} workers")
    if "boundaries_weighed" in o:
        lines.append(f"weighed {o['boundaries_weighed']} of the profile's {result.stages[-1].last_layer} boundaries: "
                     f"one per equal share of its compute, where the fewest bytes cross (the cost grows with layers "
                     f"and workers)")
    lines.append(_price_line(result))
    asked = o.get("asked_workers", result.workers)
    if result.workers < asked:
        lines.append(f"uses {result.workers} of the {asked} workers: no plan for more runs faster in the simulator "
                     f"(the partitioner's plan for {asked}, {_simulated(result, asked)}, is slower)")
    return "\n".join(lines)


def _simulated(result: Plan, workers: int) -> str:
    """The simulated rate :func:`pipetrain.predict.pipeline.best_plan` found for the plan of ``workers``."""
    found = {k: v for k, v in result.options.get("simulated", {}).items() if k.split(":")[0] == str(workers)}
    return ", ".join(f"{k.split(':')[1]} at {v:.3g} minibatches/s" for k, v in found.items()) or "not simulated"


def _price_line(result: Plan) -> str:
    """The plan's one figure (:func:`pipetrain.predict.pipeline.price_plan`), saying whether it predicts."""
    if not result.samples_per_s:
        return "not priced in samples/s: the profile records no batch size; give it with --batch-size B"
    if not result.bound:
        return (f"predicted: {result.samples_per_s:.0f} samples/s (the plan run by pipedream in the simulator, "
                "with the profile's run set-up)")
    return (f"compute-only bound: {result.samples_per_s:.0f} samples/s, not a prediction: the profile has no run "
            "set-up, so messages, syncs' latency and workers sharing cores cost nothing here (`pipetrain profile "
            f"--setup {result.workers}` measures them on the machine that will run the job)")


def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def cmd_simulate(args: argparse.Namespace) -> None:
    _at_least(args, workers=1, minibatches=1, microbatches=1, batch_size=1, latency=0, update_s=0, sync_latency=0)
    if isinstance(as_strategy(args.strategy), Auto):
        raise ValueError("simulate prices one strategy; to predict them all and pick one, run `pipetrain plan "
                         "PROFILE --workers N --strategies all`")
    given = {"staleness": args.staleness, "compression": args.compression, "chunk": args.chunk}
    strategy = make("strategy", args.strategy, {k: v for k, v in given.items() if v is not None})
    if strategy.data_parallel:
        return _simulate_data_parallel(args, strategy)
    if args.straight and not args.workers:
        raise ValueError("--straight applies to --workers (planning); --plan and --stages fix the stages")
    profile = Profile.load(args.profile)
    bandwidth = parse_bandwidth(args.bandwidth)
    if args.stages:
        boundaries = split_points(parse_stages(args.stages), [x.name for x in profile.layers], profile.model)
        replicas = [1] * len(boundaries)
    else:
        if args.plan:
            chosen = Plan.load(args.plan)
            check_fits(chosen, len(profile), args.plan)
        else:
            chosen = best_plan(profile, propose(profile, args.workers, bandwidth, straight=args.straight),
                               Link(bandwidth), args.batch_size)
        boundaries, replicas = chosen.boundaries, chosen.replicas
    chosen_schedule = schedule_of(args.schedule, args.microbatches)
    if (args.looped is not None) != chosen_schedule.looped:
        raise ValueError(f"--looped W goes with --stages and a schedule that places stages round robin "
                         f"(interleaved-1f1b), not {args.schedule!r} alone; give both or neither")
    placed = chosen_schedule.placed(args.looped)
    # a steady-state window of any count (the rounds of a replicated stage need not divide it), as `plan` prices it
    steady = args.minibatches is None
    schedule = placed.window(replicas, args.minibatches or window_minibatches(replicas))
    result = simulate(schedule, profile, boundaries, Link(bandwidth, args.latency), batch_size=args.batch_size,
                      update_s=args.update_s)
    if steady:
        rate = steady_rate(schedule, result)
        batch = profile.batch_size if args.batch_size is None else args.batch_size
        result = replace(result, minibatches_per_s=rate, samples_per_s=rate * batch if batch > 0 else None)
    names = [f"worker {w} (stage {', '.join(map(str, schedule.stages_of(w)))})" for w in range(schedule.num_workers)]
    if args.png:
        draw_timeline(result.trace, args.png, names=names,
                      title=f"{args.schedule}, stages {boundaries}, replicas {replicas}: simulated")
    if args.trace_json:
        write_chrome_trace(result.trace, args.trace_json, names=names)
    if args.json:
        print(json.dumps({"schedule": args.schedule, "stages": boundaries, "replicas": replicas,
                          **result.to_dict()}))
        return
    samples = "" if result.samples_per_s is None else f"{result.samples_per_s:.1f} samples/s, "
    print(f"{args.schedule}, stages {boundaries}, replicas {replicas}: {samples}"
          f"{result.minibatches_per_s:.2f} minibatches/s, bubble {result.bubble_fraction:.2f} ({_counts(profile)})")
    print("busy fraction per worker:   " + " ".join(f"{b:.2f}" for b in result.busy_fraction))
    print("weight versions per worker: " + " ".join(map(str, result.peak_weight_versions)))
    for path in filter(None, (args.png, args.trace_json)):
        print(f"wrote {path}")


def _counts(profile: Profile) -> str:
    """What a simulated figure counts: a prediction of the machine whose run set-up the profile holds, or
    compute and links alone."""
    if profile.setup is not None:
        return "predicted with the profile's run set-up"
    return ("compute-only bound, not a prediction: no run set-up in the profile, so messages cost only their "
            "bytes on the link; `pipetrain profile --setup N` measures the rest")


def _simulate_data_parallel(args: argparse.Namespace, strategy: Strategy) -> None:
    """``--strategy ddp|pipe-sgd|cgdp``: the paper's timing model beside a simulated run."""
    if not args.workers or args.plan or args.stages or args.straight or args.microbatches != 1:
        raise ValueError(f"--strategy {args.strategy} takes --workers N (each worker holds the whole model), "
                         "not --plan, --stages, --straight or --microbatches")
    profile = Profile.load(args.profile)
    _know_batch_size(args, profile)
    link = Link(parse_bandwidth(args.bandwidth), args.latency)
    # the workers share this machine's cores; a signal among them takes --sync-latency (CGDP)
    host = {"signal_s": args.sync_latency, "cores_per_worker": (os.cpu_count() or 1) / args.workers}
    priced = strategy.predict(profile, args.workers, link, args.batch_size, minibatches=args.minibatches,
                              update_s=args.update_s, host=host)
    result = priced.detail
    names = [f"worker {w}" for w in range(args.workers)]
    if args.png:
        draw_timeline(result.sim.trace, args.png, names=names, title=f"{args.strategy}, {args.workers} workers: "
                                                                      "simulated")
    if args.trace_json:
        write_chrome_trace(result.sim.trace, args.trace_json, names=names)
    if args.json:
        print(json.dumps({**priced.options(), "workers": args.workers, "bandwidth_Bps": link.bandwidth_Bps,
                          "latency_s": link.latency_s, "batch_size": args.batch_size or profile.batch_size,
                          "sync_latency_s": args.sync_latency, **result.to_dict()}))
        return
    how = "".join(f", {k} {v}" for k, v in priced.options().items() if k != "strategy")
    print(f"{args.strategy}, {args.workers} workers at {format_bandwidth(link.bandwidth_Bps)}{how}: {result.summary()}")
    print(_counts(profile))
    for path in filter(None, (args.png, args.trace_json)):
        print(f"wrote {path}")
