"""Time to accuracy: held-out accuracy against wall-clock seconds, PipeDream §5's metric.

    flock /tmp/pipetrain-bench.lock python benchmarks/time_to_accuracy.py     # ~4-5 min on 2 cores
    python benchmarks/time_to_accuracy.py --quick                             # ~40 s: main, one seed
    python benchmarks/time_to_accuracy.py --from-json RUN.json --target 0.9   # redraw, run nothing

Five systems train the same model (``pipetrain.zoo.digits_cnn``, initialised from the same seed) on
the real bundled digits (``pipetrain.data.digits("train")``, 1,437 images) with the same optimizer
(plain SGD), learning rate, minibatch size (32 samples per update for the whole job) and epochs, and
see the same minibatches in the same order (``pipetrain.batches.epoch_order``, shuffled per
epoch from the seed):

* ``sequential``: one process, a plain PyTorch loop in this process, all cores' threads.
* ``ddp``: ``DistributedDataParallel`` over gloo, BSP: each of the M workers takes its 32/M share
  of every minibatch and gradients are averaged, so every update equals the sequential one.
* ``pipedream``: ``pipetrain.train(schedule="pipedream")``, 1F1B with weight stashing.
* ``pipedream+vs``: the same with ``schedule=pipetrain.PipeDream(vertical_sync=True)``.
* ``naive``: ``schedule="naive"``, pipelining without weight stashing (PipeDream §3.4's ablation).
* ``pipe-sgd``, ``pipe-sgd-trunc16``, ``pipe-sgd-quant8``: ``pipetrain.train(strategy=pipetrain.PipeSGD(compression=...))``,
  K = 2 (each update one minibatch stale), each of the M workers on its share of every minibatch as
  in ``ddp``, uncompressed or with a codec inside the ring allreduce.

The distributed systems use the same worker count M (one process per worker, ``threads`` torch
threads each). After each epoch the model is kept (the pipeline systems save per-stage checkpoints,
``keep_checkpoints=None``; DDP and sequential keep a state-dict copy in memory) and evaluated on the
held-out split (``digits("test")``, 360 images) *after* the run, so evaluation costs no system time.
A point of the curve is (end of epoch e, held-out accuracy of the epoch-e model), where the clock
starts when the system is called (``pipetrain.train``'s ``result.started``; before ``spawn`` for
DDP; before building the optimizer for sequential), so process start-up, process-group set-up,
pickling the model and data to the workers and pipeline fill all count, as they do for a user.
The end of a pipeline epoch is its last history record (the output stage's last update of the
epoch; the input stage's last update follows by one backward).

Settings (``--settings``; the first two run by default):

* ``main``: M = 2 workers (one per core), 2 stages ``[0, 3]`` (conv1, ReLU, conv2 | ReLU, pool, FC
  head): conv2 is half the compute (48% profiled at 1 thread), and ending stage 0 with it balances
  best (59% | 41%); lr 0.1 (the demo's).
* ``stress``: M = 4 workers (two per core), 4 stages ``[0, 2, 3, 6]`` (conv1+ReLU | conv2 |
  ReLU+pool+flatten | FC head), lr 0.2: a deeper pipeline (the input stage's gradients are 3 updates
  stale) and a larger step, where missing weight stashing matters. DDP runs 4 workers there too.
* ``deep``: as ``stress`` at lr 0.1; ``main-lr0.3``: as ``main`` at lr 0.3. These separate the two
  knobs: at 2 stages naive stays with pipedream even at lr 0.3, and at 4 stages it does at lr 0.1.

Time to target: the first epoch end at which held-out accuracy reaches ``--target`` (default 95%;
``--also`` adds a second, default 90%); "-" when never reached. With several seeds the table gives
medians over the seeds that reached it and says how many did. Writes ``--json`` and ``--png``
(``--png none``: no plot). Runs during which other processes were busy are repeated; see
[Note: foreign load] in ``pipetrain/bench/load.py``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import functools
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, default_collate

import pipetrain
from pipetrain import data, zoo
from pipetrain.bench.load import LoadSampler, quietly
from pipetrain.bench.systems import PIPE_SGD
from pipetrain.runtime import checkpoint
from pipetrain.runtime.launch import spawn
from pipetrain.batches import epoch_order

SYSTEMS = ("sequential", "ddp", "pipedream", "pipedream+vs", "naive", *PIPE_SGD)


@dataclass(frozen=True)
class Setting:
    """One comparison: every system runs with these."""

    name: str
    workers: int
    stages: tuple[int, ...]
    lr: float
    epochs: int
    batch_size: int = 32


SETTINGS = {
    "main": Setting("main", workers=2, stages=(0, 3), lr=0.1, epochs=10),
    "stress": Setting("stress", workers=4, stages=(0, 2, 3, 6), lr=0.2, epochs=10),
    "deep": Setting("deep", workers=4, stages=(0, 2, 3, 6), lr=0.1, epochs=10),
    "main-lr0.3": Setting("main-lr0.3", workers=2, stages=(0, 3), lr=0.3, epochs=10),
}


@dataclass
class Run:
    """One system's run: epoch end times (seconds since the call) and the model after each epoch."""

    system: str
    setting: str
    seed: int
    ends: list[float]
    states: list[dict[str, torch.Tensor]]
    first_step_s: float | None    # seconds from the call to the first optimizer step (start-up + fill)
    final_loss: float | None
    error: str | None = None
    accuracy: list[float] = field(default_factory=list)
    initial_accuracy: float = float("nan")  # the untrained model's, the same for every system of a seed
    foreign_cores: float = float("nan")      # other processes' CPU use during the run, see [Note: foreign load]
    attempts: int = 1                        # runs made to get this one (see ``measure``)


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return zoo.digits_cnn()


def _batch(dataset: Dataset, idx: list[int]) -> Any:
    # the same per-item collate pipetrain's workers do, so no system gets a faster data path
    return default_collate([dataset[i] for i in idx])


def run_sequential(model: nn.Module, dataset: Dataset, s: Setting, seed: int, threads: int) -> Run:
    torch.set_num_threads(threads)
    model = copy.deepcopy(model)
    started = time.perf_counter()
    opt = torch.optim.SGD(model.parameters(), lr=s.lr)
    ends, states, first, loss = [], [], None, None
    for epoch in range(s.epochs):
        for idx in epoch_order(len(dataset), s.batch_size, epoch, True, seed, 1):  # type: ignore[arg-type]
            x, y = _batch(dataset, idx)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if first is None:
                first = time.perf_counter() - started
        ends.append(time.perf_counter() - started)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return Run("sequential", s.name, seed, ends, states, first, None if loss is None else float(loss.detach()))


def ddp_rank(model: nn.Module, dataset: Dataset, lr: float, batch_size: int, epochs: int, seed: int,
             threads: int, timeout: float = 120.0) -> dict[str, Any]:
    """One rank of BSP data parallelism (run by ``spawn``, which sets RANK/WORLD_SIZE/MASTER_*).

    Rank r takes slice r of every minibatch; DDP averages the gradients, so with a mean loss each
    update equals the sequential update on the whole minibatch. Rank 0 returns its epoch end times
    (perf_counter, the caller's clock on one machine) and its weights after every epoch.
    """
    torch.set_num_threads(threads)
    # a rank whose peers never arrive (their parent was killed) gives up instead of gloo's 30 minutes
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = batch_size // world
    net = DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    ends, states, first, loss = [], [], None, torch.zeros(())
    for epoch in range(epochs):
        for idx in epoch_order(len(dataset), batch_size, epoch, True, seed, 1):  # type: ignore[arg-type]
            x, y = _batch(dataset, idx[rank * local:(rank + 1) * local])
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            if first is None:
                first = time.perf_counter()
        ends.append(time.perf_counter())
        if rank == 0:
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    # the loss of the last minibatch, averaged over the ranks' slices as the sequential loss is
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {"ends": ends, "states": states, "first": first, "loss": float(total) / world}


def run_ddp(model: nn.Module, dataset: Dataset, s: Setting, seed: int, threads: int, timeout: float) -> Run:
    if s.batch_size % s.workers:
        raise ValueError(f"batch_size {s.batch_size} must split evenly over {s.workers} DDP workers")
    started = time.perf_counter()
    out = spawn(ddp_rank, s.workers, (model, dataset, s.lr, s.batch_size, s.epochs, seed, threads, timeout))[0]
    return Run("ddp", s.name, seed, [t - started for t in out["ends"]], out["states"], out["first"] - started,
               out["loss"])


def run_pipetrain(system: str, model: nn.Module, dataset: Dataset, s: Setting, seed: int, threads: int,
                  timeout: float) -> Run:
    if system in PIPE_SGD:
        how: dict[str, Any] = dict(strategy=pipetrain.PipeSGD(compression=PIPE_SGD[system]), workers=s.workers)
    else:
        how = dict(stages=list(s.stages), schedule=pipetrain.Naive() if system == "naive" else
                   pipetrain.PipeDream(vertical_sync=system == "pipedream+vs"))
    with tempfile.TemporaryDirectory(prefix="tta-") as ckpt:
        wall0 = time.time()
        try:
            result = pipetrain.train(
                model, dataset, loss_fn=F.cross_entropy, optimizer=functools.partial(torch.optim.SGD, lr=s.lr),
                batch_size=s.batch_size, epochs=s.epochs, shuffle=True, seed=seed, threads=threads,
                checkpoint_dir=ckpt, keep_checkpoints=None, timeout=timeout, **how)
        except pipetrain.PipetrainError as e:
            # e.g. a NaN loss: the run stops; the checkpoints of the completed epochs remain, timed by
            # their files (the last stage to save each epoch).
            return _failed_run(system, model, s, seed, ckpt, wall0, str(e))
        ends = []
        for epoch in range(s.epochs):
            last = [h["time"] for h in result.history if h["epoch"] == epoch]
            ends.append(last[-1] - result.started)
        states = [pipetrain.load_checkpoint(model, ckpt, e).state_dict() for e in range(s.epochs)]
    return Run(system, s.name, seed, ends, states, result.history[0]["time"] - result.started,
               result.history[-1]["loss"])


def _failed_run(system: str, model: nn.Module, s: Setting, seed: int, ckpt: str, wall0: float, error: str) -> Run:
    saved = checkpoint.epochs_saved(ckpt)
    world = s.workers
    done = sorted(set.intersection(*(set(saved.get(r, [])) for r in range(world)))) if saved else []
    ends, states = [], []
    for e in done:
        ends.append(max(checkpoint.path(ckpt, r, e).stat().st_mtime for r in range(world)) - wall0)
        states.append(pipetrain.load_checkpoint(model, ckpt, e).state_dict())
    return Run(system, s.name, seed, ends, states, None, None, error=error.splitlines()[0])


def accuracy(model: nn.Module, state: dict[str, torch.Tensor], test: Dataset) -> float:
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    m.eval()
    x, y = test.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        return float((m(x).argmax(1) == y).float().mean())


def time_to(run: Run, target: float) -> float | None:
    """Seconds from the call to the first epoch end whose held-out accuracy reaches ``target``."""
    return next((t for t, a in zip(run.ends, run.accuracy) if a >= target), None)


# -- load on the machine -------------------------------------------------------------------------
# Other processes may share the machine's cores outside the benchmark lock; see [Note: foreign load]
# in pipetrain/bench/load.py. Before each run the script waits (up to --wait-quiet seconds) for them
# to go below QUIET_CORES, and a run during which they used more is repeated (up to --attempts),
# keeping the quietest.
def measure(system: str, model: nn.Module, train_set: Dataset, s: Setting, seed: int,
            args: argparse.Namespace) -> Run:
    """One system's run, repeated (up to ``args.attempts``) while other processes used >= QUIET_CORES;
    the quietest attempt is kept. Every attempt computes the same thing: only its timing differs."""
    tries = itertools.count(1)

    def attempt(_: LoadSampler) -> Run:
        before = torch.get_num_threads()
        if system == "sequential":
            run = run_sequential(model, train_set, s, seed, args.seq_threads)
        elif system == "ddp":
            run = run_ddp(model, train_set, s, seed, args.threads, args.timeout)
        else:
            run = run_pipetrain(system, model, train_set, s, seed, args.threads, args.timeout)
        torch.set_num_threads(before)
        run.attempts = next(tries)
        return run

    # no sampling thread: the sequential system runs in this process; quiet means 0.5 s below QUIET_CORES
    run, cores = quietly(attempt, args.attempts, args.wait_quiet, f"{s.name} seed {seed} {system}", period=None,
                         window_s=0.5)
    run.foreign_cores = cores
    return run


# -- reporting ------------------------------------------------------------------------------------
def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else None


def summarise(runs: list[Run], target: float, also: float | None = None) -> list[dict[str, Any]]:
    """One row per (setting, system): medians over seeds.

    Times to a target are medians over the seeds that reached it (``reached`` counts them). ``s_per_epoch``
    is the median epoch duration over every epoch after the first of every seed: robust to a foreign
    process stealing a core for a second, which a mean over the run is not.
    """
    rows = []
    for setting in dict.fromkeys(r.setting for r in runs):
        for system in SYSTEMS:
            rs = [r for r in runs if r.setting == setting and r.system == system]
            if not rs:
                continue
            reached = [t for t in (time_to(r, target) for r in rs) if t is not None]
            epochs_to = [next((e + 1 for e, a in enumerate(r.accuracy) if a >= target), None) for r in rs]
            row = {
                "setting": setting, "system": system, "seeds": len(rs), "target": target, "reached": len(reached),
                "time_to_target_s": _median(reached), "epochs_to_target": _median(epochs_to),
                "final_accuracy": _median([r.accuracy[-1] if r.accuracy else None for r in rs]),
                "best_accuracy": _median([max(r.accuracy, default=None) for r in rs]),
                "total_s": _median([r.ends[-1] if r.ends else None for r in rs]),
                "first_step_s": _median([r.first_step_s for r in rs]),
                "s_per_epoch": _median([b - a for r in rs for a, b in zip(r.ends, r.ends[1:])]),
                "foreign_cores": _median([r.foreign_cores for r in rs]),
                "errors": [r.error for r in rs if r.error],
            }
            if also is not None:
                also_reached = [t for t in (time_to(r, also) for r in rs) if t is not None]
                row.update(also=also, also_reached=len(also_reached), time_to_also_s=_median(also_reached))
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], settings: dict[str, Setting]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None or v != v else format(v, fmt)

    out = []
    for name in dict.fromkeys(r["setting"] for r in rows):
        s, mine = settings[name], [r for r in rows if r["setting"] == name]
        target, also = mine[0]["target"], mine[0].get("also")
        out.append(f"**{name}**: {s.workers} workers, stages {list(s.stages)}, SGD lr {s.lr}, batch {s.batch_size}, "
                   f"{s.epochs} epochs; target {target:.0%} held-out accuracy; medians over {mine[0]['seeds']} seed(s)\n")
        extra = f" time to {also:.0%} (s) |" if also is not None else ""
        out.append(f"| system | time to {target:.0%} (s) | reached {target:.0%} (seeds) | epochs to {target:.0%} |{extra} "
                   "final acc. | best acc. | first step at (s) | s / epoch | total (s) | foreign load (cores) |")
        out.append("|---" * (10 + (also is not None)) + "|")
        for r in mine:
            extra = f" {f(r['time_to_also_s'], '.1f')}" + ("" if r["also_reached"] == r["seeds"] else
                                                          f" ({r['also_reached']}/{r['seeds']})") + " |" \
                if also is not None else ""
            out.append(f"| {r['system']} | {f(r['time_to_target_s'], '.1f')} | {r['reached']}/{r['seeds']} "
                       f"| {f(r['epochs_to_target'], 'g')} |{extra} {f(r['final_accuracy'], '.1%')} "
                       f"| {f(r['best_accuracy'], '.1%')} | {f(r['first_step_s'], '.1f')} | {f(r['s_per_epoch'], '.2f')} "
                       f"| {f(r['total_s'], '.1f')} | {f(r['foreign_cores'], '.2f')} |")
        for r in mine:
            for e in r["errors"]:
                out.append(f"\n{r['system']} stopped: {e}")
        out.append("")
    return "\n".join(out)


def plot(runs: list[Run], target: float, settings: dict[str, Setting], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.setting for r in runs))
    cols = min(2, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    colors = dict(zip(SYSTEMS, ("black", "tab:blue", "tab:green", "tab:orange", "tab:red", "tab:purple",
                                "tab:brown", "tab:pink")))
    styles = dict(zip(SYSTEMS, ("-", "-", "-", "--", ":", "-", "--", ":")))
    for ax, name in zip(axes.flat, names):
        seeds = sorted({r.seed for r in runs if r.setting == name})
        for system in SYSTEMS:
            for r in (r for r in runs if r.setting == name and r.system == system):
                main = r.seed == seeds[0]
                # flat at the untrained model's accuracy until the first optimizer step (start-up),
                # then one point per epoch end
                start = [0.0, r.first_step_s] if r.first_step_s is not None else [0.0]
                ax.plot([*start, *r.ends], [r.initial_accuracy] * len(start) + r.accuracy, styles[system],
                        marker="o" if main else None, markevery=list(range(len(start), len(start) + len(r.ends))),
                        markersize=3, color=colors[system], alpha=1.0 if main else 0.3, lw=1.6 if main else 1.0,
                        label=system if main else None)
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.text(0.3, target - 0.01, f"target {target:.0%}", color="grey", fontsize=8, va="top", ha="left",
                transform=ax.get_yaxis_transform())
        s = settings[name]
        seeds_txt = f"seed {seeds[0]} bold" + (f", seeds {seeds[1:]} faint" if len(seeds) > 1 else "")
        ax.set_title(f"{name}: {s.workers} workers, stages {list(s.stages)}, lr {s.lr}\n({seeds_txt})", fontsize=10)
        ax.set_xlabel("wall-clock seconds since the call (start-up included; points: epoch ends)")
        ax.set_ylabel("held-out accuracy (digits test split)")
        ax.set_ylim(0.0, 1.0)
        ax.grid(alpha=0.3)
    fig.suptitle("Time to accuracy: digits_cnn on scikit-learn digits, 2-core CPU, torch "
                 f"{torch.__version__.split('+')[0]}", fontsize=11)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="main,stress", help="comma-separated: " + ", ".join(SETTINGS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (model init and shuffling)")
    p.add_argument("--epochs", type=int, default=None, help="override every setting's epochs")
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--also", type=float, default=0.90, help="a second, lower target reported beside it")
    p.add_argument("--threads", type=int, default=1, help="torch threads per distributed worker")
    p.add_argument("--seq-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the sequential run (default: every core)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--wait-quiet", type=float, default=10.0,
                   help="before each run, wait up to this many seconds for other processes to quieten")
    p.add_argument("--attempts", type=int, default=3,
                   help="runs of a system while other processes are busy; the quietest is kept")
    p.add_argument("--quick", action="store_true", help="one seed, main setting only")
    p.add_argument("--json", default=None, help="write every run's curve and the table here")
    p.add_argument("--png", default=None, help="accuracy-vs-seconds plot (default docs/time_to_accuracy.png "
                   "unless --quick; none: no plot)")
    p.add_argument("--from-json", default=None, help="redraw the table and plot from a --json file; run nothing")
    args = p.parse_args(argv)
    if args.from_json:
        return redraw(Path(args.from_json), args.target, args.also, Path(args.png or "docs/time_to_accuracy.png"))
    if args.quick:
        args.seeds, args.settings = "0", "main"
    settings = {n: SETTINGS[n] for n in args.settings.split(",")}
    if args.epochs:
        settings = {n: Setting(s.name, s.workers, s.stages, s.lr, args.epochs, s.batch_size) for n, s in settings.items()}
    systems = [x for x in args.systems.split(",") if x]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    seeds = [int(x) for x in args.seeds.split(",")]
    png = (None if args.png == "none" else Path(args.png)) if args.png else \
        (None if args.quick else Path("docs/time_to_accuracy.png"))

    train_set, test_set = data.digits("train"), data.digits("test")
    # [Note: warm parent] the first optimizer a process builds imports torch._dynamo (seconds on a CPU).
    # Worker processes (ddp's too) fork from a server that has imported it; the sequential baseline runs in this
    # process, so it pays the import now, as a user's script that has built an optimizer before has.
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    t_all = time.perf_counter()
    print(f"# time to accuracy: {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    runs: list[Run] = []
    for name, s in settings.items():
        for seed in seeds:
            model = build_model(seed)
            # rotate the order per seed so no system always runs first (warm caches) or last
            order = systems[seed % len(systems):] + systems[:seed % len(systems)]
            for system in order:
                run = measure(system, model, train_set, s, seed, args)
                run.accuracy = [accuracy(model, st, test_set) for st in run.states]
                run.initial_accuracy = accuracy(model, model.state_dict(), test_set)
                run.states = []
                runs.append(run)
                tt = time_to(run, args.target)
                print(f"{name:6s} seed {seed} {system:13s} first step {run.first_step_s or float('nan'):5.1f}s "
                      f"total {run.ends[-1] if run.ends else float('nan'):5.1f}s  to {args.target:.0%}: "
                      f"{'-' if tt is None else f'{tt:.1f}s'}  acc/epoch "
                      f"{' '.join(f'{a:.3f}' for a in run.accuracy)}  foreign {run.foreign_cores:.2f} cores" + (f"  ERROR {run.error}" if run.error else ""),
                      flush=True)
    rows = summarise(runs, args.target, args.also)
    table = markdown(rows, settings)
    print()
    print(table)
    print(f"whole script: {time.perf_counter() - t_all:.0f}s; load average now {os.getloadavg()[0]:.2f}")
    if png:
        plot(runs, args.target, settings, png)
        print(f"wrote {png}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": {"node": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__,
                        "python": platform.python_version()},
            "target": args.target, "settings": {n: vars(s) | {"stages": list(s.stages)} for n, s in settings.items()},
            "rows": rows,
            "runs": [{k: v for k, v in vars(r).items() if k != "states"} for r in runs]}, indent=1))
        print(f"wrote {args.json}")
    return 0


def redraw(path: Path, target: float, also: float | None, png: Path) -> int:
    """The table and plot of an earlier run's ``--json``, e.g. at another target."""
    saved = json.loads(path.read_text())
    settings = {n: Setting(**{**v, "stages": tuple(v["stages"])}) for n, v in saved["settings"].items()}
    runs = [Run(**{**r, "states": []}) for r in saved["runs"]]
    print(markdown(summarise(runs, target, also), settings))
    if png.name != "none":
        plot(runs, target, settings, png)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
