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
    averaged over the ranks; waiting for the last rank costs CPU too (2 ranks on 2 cores: 0.16-0.19 ms
    back to back, 0.29-0.44 ms staggered by up to 2 ms).

    Ours: the repository's example MLP (a 73 KB gradient, 2 workers on 2 cores) waited 1.0 ms (median)
    and 1.8 ms (mean) for its replicated stage's allreduce, where the 1-element call's α and the
    measured ring's β priced 0.8 ms; alone, a loop of its training step and that allreduce took 0.23
    (0.53) ms per 1-element call and 0.91 (1.43) ms per gradient.

    4 ranks of mnist-mlp on 2 cores, in 5 probes each: with a thread of every rank computing all
    along, as earlier probes took α, 0.7-1.2 ms per step (means of 40 calls), and mnist-mlp's cgdp
    prediction moved 2x between probes; with nothing else running, 0.24-0.28 ms; as here, 0.27-0.42 (12
    probes). Its cgdp signals met medians of 0.19-0.25 ms per step in a traced run, 0.75 for the
    iteration's last (0.4 on average)."""
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
