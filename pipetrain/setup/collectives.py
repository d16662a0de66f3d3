"""The set-up's probe of the backend's allreduce as a job's sync meets it, and what the collective
probes share: ranks arriving staggered, and a value averaged over the ranks."""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


STAGGER_S = 0.002
"""Up to how long each rank computes, a different time in every round, before it joins an allreduce."""


def staggered_calls(fn: Callable[[], Any], rank: int, rounds: int,
                    work: Callable[[], Any] | None = None) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of each of ``rounds`` calls of ``fn`` (a collective every rank calls), after two
    untimed: before each, every rank runs ``work`` (if given: a training step) and then computes for a
    different time up to :data:`STAGGER_S`, so the ranks arrive as a job's do, the early ones waiting.
    CPU is the whole process's during the call (the backend's threads included)."""
    stagger, wall, cpu = random.Random(rank), [], []
    for _ in range(rounds + 2):
        if work is not None:
            work()
        until = time.perf_counter() + stagger.uniform(0.0, STAGGER_S)
        while time.perf_counter() < until:
            pass
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall[2:], cpu[2:]


SYNC_PROBE_S = 1.0
"""About how long :func:`allreduce_at_sync` may take: its rounds are as many training steps and calls."""


def allreduce_at_sync(kernel: Callable[[], Any], step_s: float, rank: int, rounds: int,
                      device: torch.device, nbytes: int = 4) -> tuple[float, float]:
    """(seconds, CPU seconds) per call of the backend's ``all_reduce`` of ``nbytes`` (default: 1 element)
    as a job's sync meets it: in each round every rank runs a training step (``kernel``, ``step_s``
    seconds with every rank computing), then computes its own stagger (:func:`staggered_calls`), then
    calls; its compute waits in the call, as a job's does. Rounds: ``rounds``, fewer where the steps and
    calls would take over :data:`SYNC_PROBE_S` (at least 8). Seconds: each round's time is the last
    caller's (the others were already waiting), the mean over the rounds. CPU: each rank's median,
    averaged over the ranks; waiting for the last rank costs CPU too, so the ranks arrive staggered
    as a job's do rather than lined up.

    Why after a training step and not beside a computing thread: timed while a thread of every rank
    computes all along, the call reads several times what a job's sync meets, and CGDP's prediction,
    which pays two such calls per chunk, moves with it from one probe to the next."""
    flag = torch.zeros(max(1, nbytes // 4), device=device)
    start = time.perf_counter()
    dist.all_reduce(flag)
    each = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(each, op=dist.ReduceOp.MAX)  # every rank must make as many calls
    count = max(8, min(rounds, int(SYNC_PROBE_S / max(step_s + float(each), 1e-9))))
    wall, cpu = staggered_calls(lambda: dist.all_reduce(flag), rank, count, kernel)
    last = torch.tensor(wall, dtype=torch.float64, device=device)
    dist.all_reduce(last, op=dist.ReduceOp.MIN)
    return statistics.mean(last.tolist()), mean_over_ranks(statistics.median(cpu), device)


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of every rank's ``value`` (a collective: every rank calls it)."""
    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()
