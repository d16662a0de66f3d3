"""``pipetrain train`` and ``pipetrain demo``: parse, call the API, print."""
from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path
from typing import Any

import torch

from pipetrain.cli.common import (
    add_optimizer_options, call_factory, chunk_option, load_loss, load_object, optimizer_of, parse_stages,
)
from pipetrain import data, zoo
from pipetrain.api import train
from pipetrain.metrics import METRICS, accuracy, plot_log
from pipetrain.planning.units import format_bytes
from pipetrain.runtime.dist import BACKENDS
from pipetrain.registry import DEFAULT_SCHEDULE, SCHEDULES, STRATEGIES, Auto, from_options
from pipetrain.strategies.compression import CODECS

def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` and ``demo`` subcommands."""
    p = sub.add_parser("train", help="train MODULE:FACTORY as a pipeline or data parallel")
    p.add_argument("model", help="MODULE:FACTORY returning the nn.Module (or the module itself)")
    p.add_argument("--data", required=True, help="MODULE:FACTORY returning a map-style Dataset of (input, target) "
                                                "pairs or of dictionaries (see --target-key)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--stages", help="pipeline: first layer index of each stage, one worker each, e.g. 0,2,4,6")
    where.add_argument("--plan", help="pipeline: 'auto' (profile, then plan for --workers) or a plan JSON from "
                                      "`pipetrain plan`")
    p.add_argument("--workers", type=int, default=None, help="data parallel: the workers; pipeline: workers to plan "
                                                             "for (--plan auto), checked against a plan file; "
                                                             "interleaved-1f1b: the workers --stages loop over")
    p.add_argument("--bandwidth", default=None, help="link speed --plan auto assumes, e.g. 1Gbit (default 10Gbit)")
    p.add_argument("--memory-limit", default=None,
                   help="--plan auto: bytes a worker may hold (weights, stashed versions, activations, gradients, "
                        "optimizer state and, on the CPU, its process), e.g. 16GiB")
    p.add_argument("--loss", required=True,
                   help="torch.nn.functional name (cross_entropy, mse_loss) or MODULE:FUNCTION")
    p.add_argument("--save", default=None, help="write the trained model here, stage by stage: a directory (what "
                   "save_pretrained writes: a shard per stage and its index), FILE.safetensors, or FILE.pt (torch.save "
                   "of the state dict)")
    p.add_argument("--weights", default=None, help="load the model's weights from here (a .safetensors file, a "
                   "save_pretrained directory or a torch.save'd state dict); each worker reads only its stage's")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write DIR/trace.json (Chrome trace) and DIR/timeline.png")
    _add_train_options(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plot", help="draw a metrics log (train --log-dir) to PNG: loss and evaluation curves")
    p.add_argument("log", help="the --log-dir directory, or its metrics.jsonl")
    p.add_argument("-o", "--output", default=None, help="the PNG to write (default: LOG's directory/metrics.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("demo", help="train a small CNN on bundled digits over 4 local workers")
    p.add_argument("--epochs", type=int, default=10, help="passes over the digits (default 10)")
    p.add_argument("--bandwidth", default="1Gbit", help="the network the automatic plan is made for")
    p.set_defaults(func=cmd_demo)


def _check_output(path: str | None, option: str, directory: bool = False) -> None:
    """Before training: ``path`` (a file, or a ``directory`` made if missing) can be written."""
    if path is None:
        return
    target = Path(path) if directory else Path(path).resolve().parent
    if target.exists() and not target.is_dir():
        raise ValueError(f"{option} {path}: {target} is a file, not a directory; give a path you can write")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot make {target} ({e.strerror}); give a path you can write") from None
    if Path(path).is_dir() and not directory:
        raise ValueError(f"{option} {path} is a directory; give a file name")
    if not os.access(target, os.W_OK):
        raise ValueError(f"{option} {path}: {target} is not writable; give a path you can write")


def _add_train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="pipeline",
                   help=f"{Auto.name}: {Auto.summary}; " + "; ".join(f"{s.name}: {s.summary}" for s in STRATEGIES.values())
                        + " (default pipeline)")
    p.add_argument("--allow-compression", action="store_true",
                   help="--strategy auto: may pick a codec that changes the arithmetic (trunc16, quant8)")
    p.add_argument("--schedule", default=None,
                   help=f"pipeline: {' | '.join(SCHEDULES)} (default {DEFAULT_SCHEDULE}), or auto with --plan "
                        "auto: simulate every schedule and microbatch count, print the table, run the fastest")
    p.add_argument("--vertical-sync", action="store_true",
                   help="pipedream: every stage uses the input stage's weight version")
    p.add_argument("--batch-size", type=int, default=32, help="samples per optimizer update of the whole job")
    p.add_argument("--microbatches", type=int, default=1,
                   help="pipeline, gpipe / 1f1b-flush / zero-bubble / interleaved-1f1b / 2bw: slices per minibatch")
    p.add_argument("--staleness", type=int, default=None,
                   help="pipe-sgd: K, the minibatches a gradient is applied after (default 2; 1 is synchronous)")
    p.add_argument("--compression", default=None,
                   help=f"pipe-sgd: {' | '.join(CODECS)}, applied inside the ring allreduce (float32 models)")
    p.add_argument("--warmup-epochs", type=int, default=0, help="pipe-sgd: run the first epochs with K = 1")
    p.add_argument("--chunk", default=None, type=chunk_option,
                   help="cgdp: layers per chunk, or auto (default: the run-time search)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the dataset (default 1)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many updates in all (a stream of unknown length: read once up to that)")
    add_optimizer_options(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the shuffling and every worker's random generator")
    p.add_argument("--no-shuffle", action="store_true", help="keep dataset order: minibatch t is items [tB, (t+1)B)")
    p.add_argument("--checkpoint-dir", default=None, help="each worker saves its state here after every epoch")
    p.add_argument("--resume", action="store_true", help="restart from the newest epoch all workers saved, on this split or another")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="when a worker dies or goes silent, restart every worker from the newest checkpoint, up to N "
                        "times (needs --checkpoint-dir)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait on a silent peer")
    p.add_argument("--target-key", default="labels",
                   help="dictionary items: the entry that is the target (default labels); comma-separated for "
                        "several (loss_fn then gets their tuple); the other entries are the model's keyword inputs")
    p.add_argument("--collate-fn", default=None,
                   help="MODULE:FUNCTION building a minibatch from a list of items, as DataLoader(collate_fn=) takes")
    p.add_argument("--eval-data", default=None,
                   help="MODULE:FACTORY returning held-out (input, target) pairs, evaluated after every epoch")
    p.add_argument("--metrics", default=None,
                   help="with --eval-data: comma-separated pipetrain.metrics names or MODULE:FUNCTION, e.g. accuracy")
    p.add_argument("--lr-scheduler", default=None,
                   help="MODULE:FACTORY taking the optimizer and returning a torch.optim.lr_scheduler, stepped every update")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="scale gradients to this norm at most (data parallel: global; pipeline: per stage)")
    p.add_argument("--precision", default="fp32", help="fp32 or bf16 (autocast the forward and loss to bfloat16)")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each microbatch's stage inputs until its backward, which runs the forward again "
                        "(same results, less memory, one more forward)")
    p.add_argument("--compile", action="store_true",
                   help="run every stage (data parallel: the model) through torch.compile; the first steps compile")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto (NCCL when every worker has a GPU of its own, else gloo), gloo (workers may share a "
                        "GPU) or nccl")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="background processes per worker building its next minibatches while it computes (0: inline)")
    p.add_argument("--prefetch", type=int, default=2, help="with --loader-workers: minibatches each loader keeps ready")
    p.add_argument("--log-dir", default=None, help="write DIR/metrics.jsonl (one line per update and evaluation; "
                                                   "`pipetrain plot DIR` draws it) and TensorBoard files "
                                                   "(`tensorboard --logdir DIR`; needs pipetrain[tensorboard])")


def _target_key(option: str) -> str | tuple[str, ...]:
    """``--target-key``: one key, or a tuple of the comma-separated keys."""
    keys = tuple(k.strip() for k in option.split(","))
    return keys[0] if len(keys) == 1 else keys


def cmd_train(args: argparse.Namespace) -> None:
    _check_output(args.trace, "--trace", directory=True)
    loss_fn, optimizer = load_loss(args.loss), optimizer_of(args)
    model = call_factory(args.model, "model")
    dataset = call_factory(args.data, "data")
    strategy, schedule = _strategy_and_schedule(args)
    result = train(
        model, dataset, loss_fn=loss_fn, optimizer=optimizer, strategy=strategy, schedule=schedule,
        stages=parse_stages(args.stages) if args.stages is not None else args.plan, workers=args.workers,
        bandwidth=args.bandwidth, memory_limit=args.memory_limit, batch_size=args.batch_size, epochs=args.epochs,
        shuffle=not args.no_shuffle, seed=args.seed, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
        max_restarts=args.max_restarts, timeout=args.timeout, trace=args.trace or False, progress=True,
        eval_dataset=call_factory(args.eval_data, "eval-data") if args.eval_data else None,
        metrics=_metrics(args.metrics), lr_scheduler=load_object(args.lr_scheduler) if args.lr_scheduler else None,
        clip_grad_norm=args.clip_grad_norm, precision=args.precision, recompute=args.recompute,
        compile=args.compile, log_dir=args.log_dir, backend=args.backend,
        loader_workers=args.loader_workers, prefetch=args.prefetch, target_key=_target_key(args.target_key),
        collate_fn=load_object(args.collate_fn) if args.collate_fn else None, weights=args.weights, save=args.save,
        max_steps=args.max_steps)
    for r in result.restarts:
        after = f"after epoch {r['resumed_after_epoch']}" if r["resumed_after_epoch"] is not None else "from the start"
        print(f"restarted {after}: {r['error']}")
    if result.history:
        print(f"final loss {result.history[-1]['loss']:.4f}")
    if result.epochs_trained == 0:
        print(f"nothing left to train: every requested epoch is in {args.checkpoint_dir}")
    else:
        _report_speed(result)
    if result.stashed_bytes:
        print("peak stashed activations / weight versions per worker: " + ", ".join(
            f"{format_bytes(s['activation_bytes'])} / {format_bytes(s['weight_bytes'])}" for s in result.stashed_bytes))
    if result.predicted_memory and result.measured_memory:
        what = "GPU memory allocated" if any(result.peak_device_memory) else "resident memory"
        print(f"peak {what} per worker, predicted / measured: " + ", ".join(
            f"{format_bytes(p)} / {format_bytes(m)} ({p / m - 1:+.0%})"
            for p, m in zip(result.predicted_memory, result.measured_memory)))
    if result.saved:
        print(f"saved the trained model to {result.saved}")
    if args.trace:
        print(f"wrote {args.trace}/trace.json and {args.trace}/timeline.png")


def _strategy_and_schedule(args: argparse.Namespace) -> tuple[Any, Any]:
    """The strategy and schedule objects the flags name, each with the options given to it."""
    given = {"staleness": args.staleness, "compression": args.compression, "chunk": args.chunk,
             "warmup_epochs": args.warmup_epochs or None, "allow_compression": args.allow_compression or None,
             "microbatches": args.microbatches if args.microbatches != 1 else None,
             "vertical_sync": args.vertical_sync or None}
    options = {k: v for k, v in given.items() if v is not None}
    if args.schedule == "auto":
        mine = [k for k in ("microbatches", "vertical_sync") if k in options]
        if mine:
            raise ValueError(f"--schedule auto picks the schedule and its options itself; drop "
                             f"--{mine[0].replace('_', '-')}")
        return from_options(args.strategy, None, **options)[0], "auto"
    return from_options(args.strategy, args.schedule, **options)


def _metrics(text: str | None) -> dict[str, Any] | None:
    """``--metrics accuracy,mymod:f1`` -> {name: function}: pipetrain.metrics names or MODULE:FUNCTION."""
    if not text:
        return None
    out = {}
    for name in (n.strip() for n in text.split(",") if n.strip()):
        fn = load_object(name) if ":" in name else METRICS.get(name)
        if fn is None:
            raise ValueError(f"--metrics: unknown metric {name!r}; use {' | '.join(METRICS)} or MODULE:FUNCTION")
        out[name.rsplit(":", 1)[-1]] = fn
    return out


def _report_speed(result: Any) -> None:
    """Measured samples/s, beside pipetrain's prediction when it made one (a plan, strategy auto)."""
    if result.plan is not None:
        stages = ", ".join(f"layers {s.first_layer}-{s.last_layer} x{s.replicas}" for s in result.plan.stages)
        print(f"plan {result.plan.config} ({stages}), NOAM {result.plan.noam}")
        simulated = result.plan.options.get("simulated_samples_per_s", {})
        if len(simulated) > 1:
            print("simulated before choosing: " + ", ".join(f"plan {k} {v:.0f}" for k, v in simulated.items())
                  + " samples/s")
    if result.predicted_samples_per_s:
        error = result.predicted_samples_per_s / result.samples_per_s - 1 if result.samples_per_s else float("nan")
        print(f"samples/s: predicted {result.predicted_samples_per_s:.0f}, measured {result.samples_per_s:.0f} "
              f"({error:+.0%})")
    elif result.plan is not None and result.plan.bound and result.plan.samples_per_s:
        print(f"samples/s: measured {result.samples_per_s:.0f}; no prediction: the plan's profile has no run set-up, "
              f"so it priced compute only (a bound of {result.plan.samples_per_s:.0f}); `pipetrain profile --setup "
              f"{result.plan.workers}` measures what a prediction needs")
    else:
        print(f"samples/s: measured {result.samples_per_s:.0f}")


def cmd_plot(args: argparse.Namespace) -> None:
    log = Path(args.log)
    out = args.output or str((log if log.is_dir() else log.parent) / "metrics.png")
    _check_output(out, "--output")
    print(f"wrote {plot_log(log, out)}")


def cmd_demo(args: argparse.Namespace) -> None:
    train_set, test_set = data.digits("train"), data.digits("test")
    model = zoo.digits_cnn()
    print(f"pipetrain demo: a small CNN on scikit-learn digits ({len(train_set)} train / {len(test_set)} "
          f"held out, evaluated after every epoch); profiling, then planning 4 workers for a {args.bandwidth} "
          "network; schedule pipedream")
    t0 = time.perf_counter()
    result = train(
        model, train_set, loss_fn=torch.nn.functional.cross_entropy,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5), stages="auto", workers=4,
        bandwidth=args.bandwidth, schedule="pipedream", batch_size=32, epochs=args.epochs, seed=0,
        progress=True, eval_dataset=test_set, metrics={"accuracy": accuracy})
    evaluations = [h["eval"] for h in result.history if h.get("eval")]
    print(f"final training loss {result.history[-1]['loss']:.4f}")
    print(f"held-out accuracy {evaluations[-1]['accuracy']:.1%} (chance 10%) after {len(evaluations)} epochs: "
          + " ".join(f"{e['accuracy']:.0%}" for e in evaluations))
    _report_speed(result)
    print(f"wall time {time.perf_counter() - t0:.1f}s")
