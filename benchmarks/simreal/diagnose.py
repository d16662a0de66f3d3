"""Where the time goes: runtime work a layer profile does not contain, workers slowing each other,
and time per action kind per optimizer step."""
from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import time
from typing import Any

import torch
from torch import nn

from pipetrain.timing import median_seconds
from pipetrain.trace import Record, seconds_by_kind, update_ends

from simreal.workload import Config

KINDS = ("F", "B", "U", "RF", "RB", "SF", "SB")  # the action kinds of a pipeline with one worker per stage


def time_runtime_extras(model: nn.Sequential, boundaries: list[int], repeats: int) -> dict[str, Any]:
    """Work the runtime does that the layer profile does not contain, timed in this process.

    * ``stash_copy_s``: ``pipedream``'s weight stashing copies a stage's weights into a recycled
      buffer when a forward follows an update (``Stashing._copy``): once per minibatch at every stage
      that holds more than one minibatch in flight (all but the output stage, which runs ``Live``).
    * ``accumulate_s``: with microbatches, every backward after a minibatch's first adds its
      weight gradients into ``.grad`` (autograd's AccumulateGrad: ``grad += new``), a pass over the
      stage's gradients that a layer profile, one backward at a time, never makes.
    """
    copies, accumulate = [], []
    for a, b in zip(boundaries, [*boundaries[1:], len(model)]):
        params = [p for layer in list(model)[a:b] for p in layer.parameters()]
        buffers = [torch.empty_like(p) for p in params]

        def copy() -> None:
            with torch.no_grad():
                for buf, p in zip(buffers, params):
                    buf.copy_(p)

        grads, new = [torch.zeros_like(p) for p in params], [torch.ones_like(p) for p in params]

        def add() -> None:
            for g, n in zip(grads, new):
                g += n

        copies.append(median_seconds(copy, repeats, 2))
        accumulate.append(median_seconds(add, repeats, 2))
    return {"stash_copy_s": copies, "accumulate_s": accumulate,
            "page_fault_us": page_fault_us()}


def page_fault_us(megabytes: int = 64, repeats: int = 5) -> float:
    """Median µs per minor page fault: writing fresh memory minus writing it again, per fault.

    64 MB is above glibc's largest mmap threshold, so every ``torch.empty`` maps new pages.
    """
    n = megabytes * 2**20 // 4
    per = []
    for _ in range(repeats):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        x = torch.empty(n)
        x.fill_(1.0)
        t1 = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        x.fill_(2.0)
        t2 = time.perf_counter()
        per.append(((t1 - t0) - (t2 - t1)) / max(faults, 1) * 1e6)
        del x
    return statistics.median(per)


def _busy_neighbour(model: nn.Sequential, first: int, last: int, batch: int, width: int, stop: Any,
                    ready: Any) -> None:
    """Helper process: run layers ``first..last``'s forward and backward in a loop until ``stop`` is set."""
    torch.set_num_threads(1)
    stage = nn.Sequential(*list(model)[first:last + 1])
    x = torch.randn(batch, width, requires_grad=first > 0)
    ready.set()
    while not stop.is_set():
        stage(x).float().sum().backward()


def _fb_cpu_s(stage: nn.Module, x: torch.Tensor, repeats: int) -> float:
    """Median CPU seconds (this thread's, so time-slicing with other processes does not count) of F+B."""
    times = []
    for _ in range(repeats + 2):
        c = time.thread_time()
        stage(x).float().sum().backward()
        times.append(time.thread_time() - c)
    return statistics.median(times[2:])


def corun_slowdown(cfg: Config, model: nn.Sequential, stage_layers: list[tuple[int, int]], batch: int) -> float:
    """CPU time of stage 0's F+B with stage 1's F+B running in another process / alone.

    Thread CPU time, not wall time: it does not grow when the scheduler gives the core to someone
    else, only when the work itself runs slower (shared caches, memory bandwidth, a shared physical
    core). The simulator gives each worker a device of its own, so this should be close to 1.
    """
    stage = nn.Sequential(*list(model)[stage_layers[0][0]:stage_layers[0][1] + 1])
    x = torch.randn(batch, cfg.width)
    alone = _fb_cpu_s(stage, x, cfg.repeats)
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    helper = ctx.Process(target=_busy_neighbour, args=(model, *stage_layers[1], batch, cfg.width, stop, ready),
                         daemon=True)
    helper.start()
    try:
        ready.wait(60)
        time.sleep(0.3)
        together = _fb_cpu_s(stage, x, cfg.repeats)
    finally:
        stop.set()
        helper.join(10)
        if helper.is_alive():
            helper.kill()
    return together / alone


def budget(cfg: Config, traces: list[list[Record]]) -> list[dict[str, float]]:
    """Per worker: ms per optimizer step spent in each action kind, in the steady-state window.

    The window runs from the output stage's step ``skip`` to its step ``minibatches - tail`` (the
    steps the samples/s median uses); ``other`` is the window's time in no recorded action. Receives
    include their wait for the message.
    """
    ends = update_ends(traces[-1])
    lo, hi = ends[cfg.skip - 1], ends[cfg.measured.stop - 1]
    n = len(cfg.measured)
    out = []
    for records in traces:
        b = dict.fromkeys(KINDS, 0.0) | seconds_by_kind(records, lo, hi)
        b = {k: v / n * 1e3 for k, v in b.items()}
        b["other"] = (hi - lo) / n * 1e3 - sum(b.values())
        out.append(b)
    return out
