"""The set-up's message probe: a ping-pong between two workers through the runtime's transport."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.transport import Message, Transport


MESSAGE_SIZES = (4096, 1 << 20)
"""Bytes of the two ping-pong messages a line (latency + bytes x seconds per byte) is drawn through."""


def ping_pong(transport: Transport, rank: int, rounds: int, device: torch.device,
              between: Callable[[], Any] | None = None) -> tuple[list[float], list[float]]:
    """(one-way seconds, CPU seconds per message end) at each of :data:`MESSAGE_SIZES`: means of
    ``rounds`` round trips of each between ranks 0 and 1 (other ranks only join the barrier), the sizes
    taken in turn within every round, so that both meet the same states of the machine's scheduler.
    ``between``: run by ranks 0 and 1 before each round trip, its thread's own CPU left out of the
    message's (what the transport and gloo threads did meanwhile is kept), not timed. Taken one size
    after the other instead, each size meets a different phase of the machine, and the line's
    intercept and slope trade errors."""
    payloads = [torch.zeros(n // 4, device=device) for n in MESSAGE_SIZES]
    wall, cpu = [0.0] * len(payloads), [0.0] * len(payloads)
    dist.barrier()
    if rank > 1:
        return wall, cpu
    for k in range(rounds):
        for i, payload in enumerate(payloads):
            c0 = time.process_time()
            if between is not None:
                own = time.thread_time()
                between()
                c0 += time.thread_time() - own
            tag, t0 = k * len(payloads) + i, time.perf_counter()
            if rank == 0:
                transport.send(1, Message(tag, None, 0, [payload], False))
                transport.recv(1, tag, None, "the pong")
            else:
                transport.recv(0, tag, None, "the ping")
                transport.send(0, Message(tag, None, 0, [payload], False))
            wall[i] += (time.perf_counter() - t0) / (2 * rounds)
            cpu[i] += (time.process_time() - c0) / (2 * rounds)
    return wall, cpu


COMPUTING_ROUNDS_SECONDS = 2.0
"""About how long the ping-pong after a training step (:func:`computing_rounds`) may take. It is
timed after a step because a message's transport and gloo threads that run right after one find the
caches holding the step's data, and cost more CPU than with nothing else running.

[Note: message CPU after a step] About 3x: a 256 KB message end on sim_vs_real's MLP (2 workers, 2
cores); the run set-up line of ``python benchmarks/sim_vs_real.py --quick`` prints both."""


def computing_rounds(step_s: float, rounds: int) -> int:
    """Round trips of the ping-pong after a step of ``step_s`` seconds: ``rounds``, fewer where they
    would take over :data:`COMPUTING_ROUNDS_SECONDS`, at least 3."""
    per_round = len(MESSAGE_SIZES) * max(step_s, 1e-9)
    return max(3, min(rounds, int(COMPUTING_ROUNDS_SECONDS / per_round)))


def fit_line(points: list[float], sizes: tuple[int, int] = MESSAGE_SIZES) -> tuple[float, float]:
    """(intercept at 0 bytes, slope per byte) of the line through ``sizes`` (bytes) and ``points``,
    neither below 0."""
    slope = max(0.0, points[1] - points[0]) / (sizes[1] - sizes[0])
    return max(0.0, points[0] - sizes[0] * slope), slope
