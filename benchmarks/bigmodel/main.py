"""The command line: one size against torch's recipe, or ``--largest`` of several sizes."""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bigmodel.model import SIZES, config_of, job_data, parameters, write_checkpoint
from bigmodel.ours import run_pipetrain, saved_loss
from bigmodel.report import GIB, largest_table, ours_summary, table, torch_summary, verdict
from bigmodel.torch_recipe import run_torch
from pipetrain.config import shared_cores
from pipetrain.errors import one_line
from pipetrain.runtime.launch import spawn
from pipetrain.weightfiles import INDEX

RANKS = 4


def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train a Llama bigger than one worker with pipetrain and with "
                                             "torch.distributed.pipelining, from and to a sharded checkpoint")
    ap.add_argument("--size", choices=list(SIZES), default="1.5b")
    ap.add_argument("--largest", default=None, metavar="SIZE,SIZE,...",
                    help="run pipetrain's job at each size in turn and report the largest that trains")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pipetrain-big-model",
                    help="where checkpoints (kept, reused) and trained models (removed once checked) go")
    ap.add_argument("--checkpoint", type=Path, default=None, help="the initial checkpoint (default WORKDIR/SIZE); "
                    "written if missing, reused if there")
    ap.add_argument("--out", type=Path, default=None, help="keep the trained model here (default: removed)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each system, taking turns; medians shown")
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a worker waits on a silent peer")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    unknown = [s for s in (args.largest or "").split(",") if s and s not in SIZES]
    if unknown:
        ap.error(f"--largest: no size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    return args


def warm_launcher() -> None:
    """Start the fork server that both systems' workers are forked from: it imports torch first, which
    neither system's start-up should be charged."""
    spawn(_nothing, 1, ())


def _nothing() -> None:
    return None


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Both systems on one size, ``--repeats`` times each, taking turns to go first; prints as it goes
    and returns every number."""
    config = config_of(args.size)
    n = parameters(config)
    checkpoint = args.checkpoint or args.workdir / args.size
    out = args.out or args.workdir / f"{args.size}-trained"
    print(f"big_model: Llama {args.size!r}, {n:,} parameters ({4 * n / GIB:.2f} GiB in float32), {RANKS} stages of "
          f"{config.num_hidden_layers // RANKS} decoder layers, batch {args.batch} x {args.seq} tokens, "
          f"{args.microbatches} microbatches, {args.updates} SGD updates", flush=True)
    began = time.perf_counter()
    wrote = write_checkpoint(checkpoint, config)
    print(f"checkpoint {checkpoint}: {'written' if wrote else 'reused'} ({time.perf_counter() - began:.1f} s)",
          flush=True)
    warm_launcher()
    data = job_data(config, args.updates, args.batch, args.seq)
    threads = shared_cores(RANKS)

    def ours() -> dict[str, Any]:
        shutil.rmtree(out, ignore_errors=True)
        return run_pipetrain(config, checkpoint, out, data, args.batch, args.microbatches, args.lr, threads,
                             args.timeout)

    jobs = {"pipetrain": ours, "torch": lambda: run_torch(checkpoint, *data[:], args.batch, args.microbatches,
                                                           args.lr, threads, RANKS)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    for repeat in range(args.repeats):
        for name in sorted(jobs, reverse=repeat % 2 == 1):
            runs[name].append(jobs[name]())
            losses = runs[name][-1]["losses"] if name == "pipetrain" else runs[name][-1]["ranks"][-1]["losses"]
            print(f"{name}: losses {losses}", flush=True)
    last = runs["pipetrain"][-1]["losses"]
    loaded = saved_loss(out, *data[:args.batch])  # the last pipetrain run's save
    if args.out is None:
        shutil.rmtree(out)
    ours_median, theirs_median = ours_summary(runs["pipetrain"]), torch_summary(runs["torch"])
    met, line = verdict(ours_median, theirs_median)
    check = {"pipetrain": last[-1], "from_pretrained": loaded, "difference": loaded - last[-1],
             "before_training": last[0]}
    found = {"size": args.size, "parameters": n, "checkpoint": str(checkpoint), "checkpoint_written": wrote,
             "runs": runs, "pipetrain": ours_median, "torch": theirs_median, "loss_check": check,
             "caller_peak_memory": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "verdict": met}
    print(f"\nmedians of {args.repeats} run(s) each:\n{table(ours_median, theirs_median)}")
    print(f"\nloss check, minibatch 0 under the saved weights: pipetrain {check['pipetrain']:.7f}, from_pretrained "
          f"in a fresh process {loaded:.7f}, difference {check['difference']:.1e} (before training: "
          f"{check['before_training']:.7f})")
    worst = max(abs(a - b) for a, b in zip(last, runs["torch"][-1]["ranks"][-1]["losses"]))
    print(f"the same losses in both systems: largest difference {worst:.1e}")
    print(f"this process's peak memory: {found['caller_peak_memory'] / GIB:.2f} GiB; the model's weights: "
          f"{4 * n / GIB:.2f} GiB")
    print(f"verdict: {line}")
    return found


def largest(args: argparse.Namespace) -> dict[str, Any]:
    """pipetrain's job at each ``--largest`` size in turn until one fails; a checkpoint this run wrote is
    removed after its size (they are large), one that was there is kept."""
    rows: list[dict[str, Any]] = []
    warm_launcher()
    for size in args.largest.split(","):
        config = config_of(size)
        row: dict[str, Any] = {"size": size, "parameters": parameters(config)}
        checkpoint, out = args.workdir / size, args.workdir / f"{size}-trained"
        existed = (checkpoint / INDEX).exists()
        try:
            write_checkpoint(checkpoint, config)
            data = job_data(config, args.updates, args.batch, args.seq)
            row["pipetrain"] = run_pipetrain(config, checkpoint, out, data, args.batch, args.microbatches, args.lr,
                                             shared_cores(RANKS), args.timeout)
        except Exception as e:  # noqa: BLE001 - a size that does not train is the answer, not a crash
            row["error"] = one_line(e, None)
        finally:
            shutil.rmtree(out, ignore_errors=True)
            if not existed:
                shutil.rmtree(checkpoint, ignore_errors=True)
        rows.append(row)
        print(f"{size}: {'trained' if 'error' not in row else row['error']}", flush=True)
        if "error" in row:
            break
    trained = [row["size"] for row in rows if "error" not in row]
    print(largest_table(rows))
    print(f"largest that trains: {trained[-1] if trained else 'none'}")
    return {"rows": rows, "largest": trained[-1] if trained else None}


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    found = largest(args) if args.largest else compare(args)
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
