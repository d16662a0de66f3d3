"""The set-up's probes of Pipe-SGD's allreduce (:func:`pipetrain.strategies.ring.allreduce`): its
line busy and idle, its CPU, and pipe-sgd's own loop where the workers share cores."""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.setup.collectives import mean_over_ranks, staggered_calls
from pipetrain.setup.messages import fit_line
from pipetrain.strategies.compression import CODECS, Codec, get_codec
from pipetrain.strategies.ring import allreduce, block_size
from pipetrain.timing import median_seconds


RING_BYTES = (1 << 16, 1 << 20, 1 << 25)
"""Gradient bytes of the small ring allreduce, and the bounds of the large one (:func:`ring_line`)."""
RING_CPU_MAX_BYTES = 1 << 27
"""The largest gradient :func:`ring_cpu_line` allreduces (a larger job's is priced from its line)."""
RING_CPU_SECONDS = 1.0
"""About how long :func:`ring_alone` times one ring allreduce over (fewer calls on a slow link)."""
RING_CPU_CALLS = (3, 9)
"""The fewest and the most calls :func:`ring_alone` takes the median of."""
PERIOD_CALLS = (3, 24)
"""The fewest and the most iterations of pipe-sgd's loop :func:`pipe_sgd_period` takes the median of:
its iterations vary with the machine's phases, about as much as a job's own do."""
RING_SECONDS = 0.1
"""About how long the large ring allreduce should take, judged from the ping-pong's seconds per byte."""


def ring_sizes(s_per_byte: float) -> tuple[int, int]:
    """The gradient bytes of :func:`ring_line`'s two allreduces: :data:`RING_BYTES`' small one, and as
    many bytes as rank 0's ``s_per_byte`` moves in :data:`RING_SECONDS`, within its bounds."""
    big = [min(RING_BYTES[2], max(RING_BYTES[1], int(RING_SECONDS / max(s_per_byte, 1e-12))))]
    dist.broadcast_object_list(big, src=0)
    return RING_BYTES[0], big[0]


def ring_line(rank: int, sizes: tuple[int, int], device: torch.device, rounds: int,
              big_rounds: int = 3) -> tuple[float, float]:
    """(α, β) of :func:`pipetrain.strategies.ring.allreduce` over every rank (all call it; the
    set-up calls it while a thread of each rank computes, then with nothing else running): the ring
    model's line through two gradient ``sizes`` (:func:`ring_sizes`). Small: ``rounds`` staggered
    allreduces (:func:`~pipetrain.setup.collectives.staggered_calls`), each rank's median, waiting
    included, averaged over the ranks: a job's ranks arrive staggered, which costs each step more
    than calls lined up by a barrier do, and a few rounds vary widely. Large: ``big_rounds`` lined
    up by a barrier, sized to take about :data:`RING_SECONDS` on the link: a long transfer costs
    more per byte than a line through one message's sizes says."""
    world = dist.get_world_size()
    small, large = (torch.zeros(world, block_size(n // 4, world, 1), device=device) for n in sizes)
    # the small one staggered, as a job's ranks arrive: each rank's own time, waiting included, is a
    # period of a ring that runs one allreduce after another; the mean over the ranks
    held: dict[str, torch.Tensor] = {}  # as a job's ring keeps its buffers
    small_s = statistics.median(staggered_calls(lambda: allreduce(small, None, get_codec(None), held), rank,
                                                rounds)[0])
    times = [mean_over_ranks(small_s, device),
             median_seconds(lambda: allreduce(large, None, get_codec(None), held), big_rounds, sync=dist.barrier)]
    hops, share = 2 * (world - 1), 2 * (world - 1) / world
    per_byte = max(0.0, times[1] - times[0]) / (share * (sizes[1] - sizes[0]))
    return max(0.0, times[0] - share * sizes[0] * per_byte) / hops, per_byte


def ring_cpu_line(device: torch.device, sizes: tuple[int, int]) -> tuple[float, float, float]:
    """(CPU seconds per step, per byte of its block, seconds of the larger ring) of
    :func:`pipetrain.strategies.ring.allreduce` over every rank with nothing else running
    (:func:`ring_alone`) at two gradient ``sizes`` (bytes): the line of
    :func:`pipetrain.costs.ring_allreduce_cpu_s` through the two, and how long the ``sizes[1]`` one
    took. The line is not straight over all sizes: a block travels in 1 to 16 messages ([Note: chunks]
    in :mod:`pipetrain.strategies.ring`), whose CPU grows in steps with their size, so the job's own
    size is measured when it is known. With a thread of every rank computing it is about as much, so
    it is timed alone."""
    world, codec = dist.get_world_size(), CODECS["none"]
    block = [block_size(nbytes // 4, world, 1) for nbytes in sizes]  # elements per rank's block
    alone = [ring_alone(device, codec, nbytes) for nbytes in sizes]
    return (*fit_line([cpu / (2 * (world - 1)) for cpu, _ in alone], (4 * block[0], 4 * block[1])), alone[1][1])


def ring_alone(device: torch.device, codec: Codec, nbytes: int) -> tuple[float, float]:
    """(CPU seconds, seconds) of one :func:`pipetrain.strategies.ring.allreduce` of a float32
    gradient of ``nbytes`` with ``codec`` over every rank, nothing else running: calls lined up by a
    barrier after one that warms the ring's buffers up, each rank's median CPU of its whole process
    (gloo's threads included) and median time, each averaged over the ranks. As many calls as fit in
    :data:`RING_CPU_SECONDS` (by the slowest rank's warm-up), between :data:`RING_CPU_CALLS`: one
    call's CPU varies a lot from call to call and from rank to rank."""
    ring = _job_ring(device, codec, nbytes)
    dist.barrier()
    w0 = time.perf_counter()
    ring()
    warm = torch.tensor([time.perf_counter() - w0], dtype=torch.float64, device=device)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    cpu, wall = [], []
    for _ in range(_calls(float(warm), RING_CPU_CALLS)):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        ring()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return mean_over_ranks(statistics.median(cpu), device), mean_over_ranks(statistics.median(wall), device)


def pipe_sgd_period(kernel: Callable[[], Any], device: torch.device, codec: Codec, nbytes: int,
                    ring_s: float) -> float:
    """Seconds per iteration of pipe-sgd's loop at K = 2 (a collective: every rank calls it): each rank
    runs ``kernel`` (its training step), waits for the ring allreduce of the step before (a float32
    gradient of ``nbytes``, with ``codec``), which ran on a communication thread beside it, and starts
    the next; the median time between the waits' ends, averaged over the ranks. As many iterations as
    rings of ``ring_s`` (the ring alone; the same on every rank) fit in :data:`RING_CPU_SECONDS`, within
    :data:`PERIOD_CALLS`."""
    ring = _job_ring(device, codec, nbytes)
    ends: list[float] = []
    with ThreadPoolExecutor(1) as comm:
        pending = comm.submit(ring)  # warms the buffers up
        kernel()
        pending.result()
        dist.barrier()
        for i in range(_calls(ring_s, PERIOD_CALLS) + 2):
            kernel()
            if i:
                pending.result()
                ends.append(time.perf_counter())
            pending = comm.submit(ring)
        pending.result()
    return mean_over_ranks(statistics.median(b - a for a, b in zip(ends, ends[1:])), device)


def _job_ring(device: torch.device, codec: Codec, nbytes: int) -> Callable[[], Any]:
    """One :func:`pipetrain.strategies.ring.allreduce` of a float32 gradient of ``nbytes`` with
    ``codec`` over every rank, as a call that keeps its buffers between calls, as a job's ring does."""
    world = dist.get_world_size()
    blocks = torch.zeros(world, block_size(nbytes // 4, world, codec.granule), device=device)
    held: dict[str, torch.Tensor] = {}
    return functools.partial(allreduce, blocks, None, codec, held)


def _calls(each_s: float, bounds: tuple[int, int]) -> int:
    """How many calls of ``each_s`` seconds fit in :data:`RING_CPU_SECONDS`, within ``bounds``."""
    return min(bounds[1], max(bounds[0], int(RING_CPU_SECONDS / max(each_s, 1e-6))))
