"""What one worker costs: each strategy on one worker beside a plain PyTorch loop, and a pipeline's time
outside its actions, read off the trace.

    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/overhead.py --model mlp   # ~2 min
    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/overhead.py --model vgg   # ~3 min
    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/overhead.py --outside     # ~6 min

Ratios: the same model, data (a ``TensorDataset``), SGD and torch threads (``--threads``, default 1),
the same number of minibatches, trained by a plain loop (``zero_grad``, forward, loss, ``backward``,
``step`` over a shuffled ``TensorDataset``, in this process) and by ``pipetrain.train`` on one worker: a
one-stage pipeline (``stages=[0]``) under ``pipedream`` and each flush schedule that runs one stage
(``interleaved-1f1b`` needs 2 workers), and ``ddp``, ``pipe-sgd`` and ``cgdp`` with ``workers=1``.
``2bw`` is also set beside a plain loop with its update rule (:func:`two_bw_step`), whose weight copy any
implementation pays: that ratio is its runtime's overhead. Each run's rate is samples/s over the updates
after the first ``--warmup``, from the update timestamps (``result.history``; the plain loop's are taken
the same way), and also at its median time between two updates (less moved by other processes). Every
configuration runs once per round, interleaved, and the plain loop once more at each round's end: the
ratio of the two plain loops is how far identical runs differ here. Tables give the median of
``--repeats`` rounds and ratios of medians. The plain loop runs with the allocator setting the workers
use (:func:`pipetrain.runtime.launch.keep_freed_memory`), so a ratio counts pipetrain's work, not
malloc's. Models: ``mlp`` (784-1024-1024-10, batch 64) and ``vgg`` (:func:`pipetrain.zoo.vgg_like`,
32x32 images, batch 8).

``--outside``: a 2-stage MLP pipeline (``interleaved-1f1b``: 4 stages on 2 workers) under each schedule
(the flush schedules at 4 microbatches), traced. Per worker, over the minibatches after the warm-up:
each kind of action's share of its wall time (forward and backward passes, the update, sending and
waiting for messages) and the share covered by no action: what the worker spends between actions,
outside all of these.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import pipetrain
from pipetrain import Interleaved1F1B
from pipetrain.registry import schedule_of
from pipetrain.runtime.launch import keep_freed_memory
from pipetrain.trace import seconds_by_kind, update_ends
from pipetrain.zoo import vgg_like

MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    # name: (model, one input's shape, batch)
    "mlp": (lambda: nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                  nn.Linear(1024, 10)), (784,), 64),
    "vgg": (vgg_like, (3, 32, 32), 8),
}
STEPS = {"mlp": 200, "vgg": 40}
"""Minibatches per run: a few seconds of training each on one core."""

RUNS: dict[str, dict[str, Any]] = {
    "pipeline pipedream, stages=[0]": dict(stages=[0]),
    **{f"pipeline {s}, stages=[0]": dict(stages=[0], schedule=s) for s in ("gpipe", "1f1b-flush", "zero-bubble", "2bw")},
    **{f"{s}, workers=1": dict(strategy=s, workers=1) for s in ("ddp", "pipe-sgd", "cgdp")},
}
PLAIN = "plain PyTorch loop"
PLAIN_2BW = "plain loop, 2BW's rule"
RULE_OF = {"pipeline 2bw, stages=[0]": PLAIN_2BW}
"""The loop of a run's own update rule where it is not the plain loop's: ``2bw`` runs each minibatch at
the weights before the last update, which needs a second copy of the weights whatever runs it."""
OUTSIDE: dict[str, dict[str, Any]] = {"pipedream": dict(stages=[0, 2])}
OUTSIDE.update({s: dict(stages=[0, 2], schedule=schedule_of(s, 4)) for s in ("1f1b-flush", "gpipe", "zero-bubble", "2bw")})
OUTSIDE["interleaved-1f1b"] = dict(stages=[0, 1, 2, 3], schedule=Interleaved1F1B(workers=2, microbatches=4))
"""A flush schedule splits each minibatch into 4 microbatches (2bw needs at least one per stage)."""
OUTSIDE_STEPS = 150


def model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def dataset(name: str, steps: int) -> torch.utils.data.TensorDataset:
    _, shape, batch = MODELS[name]
    g = torch.Generator().manual_seed(0)
    n = batch * steps
    return torch.utils.data.TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g))


def rate(times: list[float], warmup: int, batch: int) -> float:
    """Samples/s between the ``warmup``-th update and the last."""
    kept = times[warmup:]
    return batch * (len(kept) - 1) / (kept[-1] - kept[0])


def typical_rate(times: list[float], warmup: int, batch: int) -> float:
    """Samples/s at the median time between two updates after the ``warmup``-th: what a step takes
    when no other process on the machine interrupts it."""
    kept = times[warmup:]
    return batch / statistics.median(b - a for a, b in zip(kept, kept[1:]))


Step = Callable[[torch.Tensor, torch.Tensor], None]


def timed_loop(name: str, data: torch.utils.data.TensorDataset, threads: int, make_step: Callable[[], Step]) -> list[float]:
    """The update timestamps of a loop over ``data``'s shuffled minibatches, each taken by the step
    ``make_step`` builds (with ``threads`` torch threads)."""
    batch = MODELS[name][2]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    step = make_step()
    x, y = data.tensors
    order, times = torch.randperm(len(x)), []
    for i in range(len(x) // batch):
        idx = order[i * batch:(i + 1) * batch]
        step(x[idx], y[idx])
        times.append(time.perf_counter())
    torch.set_num_threads(before)
    return times


def plain_step(name: str) -> Step:
    """A plain PyTorch step: ``zero_grad``, forward, loss, ``backward``, ``step``."""
    net = model(name)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return step


def two_bw_step(name: str) -> Step:
    """A plain step with PipeDream-2BW's update rule, W(t+1) = W(t) - lr * grad f(W(t-1)): forward and
    backward on a second copy of the model holding the weights before the last update, whose gradient
    the live model's optimizer applies after that copy takes the live weights. What any implementation
    of the rule does on one worker, so 2bw's ratio to it is the runtime's overhead alone."""
    net, old = model(name), model(name)
    live, held = list(net.parameters()), list(old.parameters())
    opt = torch.optim.SGD(live, lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        old.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(old(x), y).backward()
        for p, q in zip(live, held):
            p.grad = q.grad
        with torch.no_grad():
            torch._foreach_copy_(held, live)
        opt.step()
    return step


def train(name: str, data: torch.utils.data.TensorDataset, threads: int, **layout: Any) -> pipetrain.TrainResult:
    return pipetrain.train(model(name), data, loss_fn=nn.functional.cross_entropy,
                           optimizer=functools.partial(torch.optim.SGD, lr=0.01), batch_size=MODELS[name][2],
                           epochs=1, threads=threads, **layout)


def ratios(name: str, repeats: int, warmup: int, threads: int) -> None:
    keep_freed_memory()  # as every worker does: see the module's docstring
    data, batch = dataset(name, STEPS[name]), MODELS[name][2]
    runs: dict[str, Callable[[], list[float]]] = {
        PLAIN: lambda: timed_loop(name, data, threads, lambda: plain_step(name)),
        PLAIN_2BW: lambda: timed_loop(name, data, threads, lambda: two_bw_step(name))}
    for label, layout in RUNS.items():
        runs[label] = functools.partial(lambda lay: [h["time"] for h in train(name, data, threads, **lay).history],
                                        layout)
    # the same loop again, last in each round: how far two identical runs differ on this machine
    runs[f"{PLAIN}, again"] = runs[PLAIN]
    rates: dict[str, list[float]] = {label: [] for label in runs}
    typical: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeats):  # interleaved: each configuration sees the same phases of the machine
        for label, run in runs.items():
            times = run()
            rates[label].append(rate(times, warmup, batch))
            typical[label].append(typical_rate(times, warmup, batch))
    base, typical_base = (statistics.median(r[PLAIN]) for r in (rates, typical))
    print(f"{name}: batch {batch}, {STEPS[name]} minibatches, rate over the last {STEPS[name] - warmup}, "
          f"{threads} torch thread(s)")
    print(f"| run | samples/s (median of {repeats}) | x plain loop | x the loop of its rule | runs | at the median "
          "step | x plain loop |\n|---|---|---|---|---|---|---|")
    for label, values in rates.items():
        m, t = statistics.median(values), statistics.median(typical[label])
        rule = statistics.median(rates[RULE_OF.get(label, PLAIN)])
        print(f"| {label} | {m:.0f} | {m / base:.3f} | {m / rule:.3f} | {', '.join(f'{v:.0f}' for v in values)} | "
              f"{t:.0f} | {t / typical_base:.3f} |")


def outside(repeats: int, warmup: int, threads: int) -> None:
    """Per schedule and worker: the shares of its steady-state wall time in each kind of action and
    between actions (medians of ``repeats`` runs)."""
    steps = OUTSIDE_STEPS
    data = dataset("mlp", steps)
    print(f"mlp, 2 stages ({threads} torch thread(s) per worker), {steps} minibatches, the last {steps - warmup}")
    print(f"| schedule | worker | ms per minibatch | {' | '.join(KINDS)} | outside actions | outside, runs |\n"
          f"|---|---|---|{'---|' * len(KINDS)}---|---|")
    for schedule, layout in OUTSIDE.items():
        runs: dict[int, list[dict[str, float]]] = {}
        for _ in range(repeats):
            result = train("mlp", data, threads, trace=True, **layout)
            for rank, trace in enumerate(result.traces):
                runs.setdefault(rank, []).append(shares(trace, warmup))
        for rank, got in runs.items():
            med = {k: statistics.median(r[k] for r in got) for k in got[0]}
            cells = " | ".join(f"{100 * med[k]:.1f}%" for k in KINDS)
            each = ", ".join(f"{100 * r['outside']:.2f}%" for r in got)
            print(f"| {schedule} | {rank} | {1e3 * med['step_s']:.2f} | {cells} | {100 * med['outside']:.2f}% | {each} |")


KINDS = {"forward, backward": ("F", "B", "I", "W"), "update": ("U",), "messages": ("SF", "SB", "RF", "RB"),
         "gradient sync": ("A", "S")}
"""The columns of ``--outside``: the action kinds each counts."""


def shares(trace: list[tuple[str, float, float]], warmup: int) -> dict[str, float]:
    """From the end of the ``warmup``-th update to the last: each of :data:`KINDS`' share of the wall
    time, the share covered by no action (``outside``), and the seconds per minibatch (``step_s``)."""
    ends = update_ends(trace)
    first = min(warmup, len(ends) - 1)
    start, end = ends[first], ends[-1]
    spent = seconds_by_kind(trace, start, end)
    out = {label: sum(spent.get(k, 0.0) for k in kinds) / (end - start) for label, kinds in KINDS.items()}
    out["outside"] = 1 - sum(out.values())
    out["step_s"] = (end - start) / (len(ends) - 1 - first)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--outside", action="store_true", help="the pipeline schedules' time outside actions instead")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10, help="updates left out of the rate")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the loop and of each worker")
    args = p.parse_args()
    if args.outside:
        outside(args.repeats, args.warmup, args.threads)
    else:
        ratios(args.model, args.repeats, args.warmup, args.threads)


if __name__ == "__main__":
    main()
