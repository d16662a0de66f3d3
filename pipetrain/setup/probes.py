"""Measure the run set-up (:class:`~pipetrain.setup.data.Setup`) of a job's workers on this machine.

A layer profile times each layer alone in one process. The runtime's workers are several processes:
on one machine they share its cores, and every message between them costs time on the wire and CPU
at both ends (the transport's threads, gloo's I/O loop). :func:`measure_setup` measures both with the
runtime's own launcher and transport.
"""
from __future__ import annotations

import functools
import os
import statistics
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.dist import init_distributed
from pipetrain.runtime.launch import spawn
from pipetrain.runtime.transport import Transport
from pipetrain.setup.collectives import allreduce_at_sync
from pipetrain.setup.compute import SETTLE_SECONDS, ModelStep, matmul, memory_s_per_byte, run_for, sample_compute
from pipetrain.setup.data import Setup
from pipetrain.setup.messages import computing_rounds, fit_line, ping_pong
from pipetrain.setup.ring import (RING_BYTES, RING_CPU_MAX_BYTES, pipe_sgd_period, ring_alone, ring_cpu_line,
                                  ring_line, ring_sizes)
from pipetrain.strategies.allreduce import BUCKET_BYTES
from pipetrain.strategies.compression import CODECS


Launcher = Callable[[Callable[..., Any], tuple, int], list[Any]]
"""``launch(fn, args, world)``: run ``fn(*args)`` as ranks 0..world-1 and return their results."""


def measure_setup(workers: int, threads: int, kernel: Callable[[], Any] | None = None, seconds: float = 0.3,
                  rounds: int = 20, timeout: float = 60.0, launch: Launcher | None = None,
                  compute_rounds: int = 3, ring_bytes: int | None = None, ring_cpu: bool = True,
                  settle_s: float = SETTLE_SECONDS, backend: str = "auto") -> Setup:
    """Measure the set-up of ``workers`` worker processes of ``threads`` torch threads on this machine.

    It starts max(2, ``workers``) processes with ``launch`` (default: the runtime's launcher; the
    emulated cluster's puts each on its own host). Compute, ``compute_rounds`` times: rank 0 runs
    ``kernel`` (default: a float32 matmul; pass one training step of the model for a faithful
    figure) alone for ``seconds``, then every rank runs it at once; ``slowdown`` is the median over
    the rounds of the ranks' mean time per call over rank 0's alone, and ``jitter_s`` the median of
    how much those calls varied (:func:`~pipetrain.setup.compute.jitter_of_calls`); where the
    slowdown reads more than the cores explain, rounds go on for up to ``settle_s``
    (:func:`~pipetrain.setup.compute.sample_compute`). Messages: ranks 0 and 1 play ping-pong through
    the runtime's :class:`~pipetrain.runtime.transport.Transport` at each of
    :data:`~pipetrain.setup.messages.MESSAGE_SIZES`, one way being half a round trip: first with
    nothing else running in the two processes, for the idle latency and the CPU time per message end
    (and the backend's ``all_reduce`` of 1 element among every rank, as a job's sync meets it:
    :func:`~pipetrain.setup.collectives.allreduce_at_sync`); then while a thread of every rank runs
    ``kernel``, as the compute threads of a running job do, for the time per message (its transport
    threads then wait for a core) and our ring's line. Our ring's CPU is measured with nothing else
    running (:func:`~pipetrain.setup.ring.ring_cpu_line`) at ``ring_bytes`` (the job's gradient: pass
    the model's parameter bytes) and a quarter of it, and at ``ring_bytes`` with each lossy codec
    (unless it is below 4 x 64 KB or above :data:`~pipetrain.setup.ring.RING_CPU_MAX_BYTES`), else at
    two of :data:`~pipetrain.setup.ring.RING_BYTES` and with no codec. Only pipe-sgd's prediction
    reads our ring's CPU: with ``ring_cpu=False`` (a pipeline's planning) it is not measured, as it
    makes the set-up of a large gradient take about half as long again, and on a slow link each of
    those rings takes seconds. The workers join on ``backend``, as the job's will
    (:data:`pipetrain.runtime.dist.BACKENDS`).
    """
    kernel = kernel or functools.partial(matmul, 256)
    run = launch or (lambda fn, args, world: spawn(fn, world, args, describe="set-up probe {}".format))
    big = RING_BYTES[2] if ring_bytes is None else min(RING_CPU_MAX_BYTES, max(ring_bytes, 4 * RING_BYTES[0]))
    sizes = (RING_BYTES[1], big) if ring_bytes is None else (big // 4, big)
    codec_bytes = big if big == ring_bytes and ring_cpu else 0  # where a job's gradient can match it
    shared = workers >= 2 and workers * threads > (os.cpu_count() or 1)
    allreduce_bytes = min(BUCKET_BYTES, ring_bytes or BUCKET_BYTES)
    results = run(_probe, (workers, threads, kernel, seconds, rounds, timeout, compute_rounds, settle_s,
                           sizes if ring_cpu else None, codec_bytes, shared, allreduce_bytes, backend),
                  max(2, workers))
    return Setup(**results[0])


def _probe(workers: int, threads: int, kernel: Callable[[], Any], seconds: float, rounds: int,
           timeout: float, compute_rounds: int, settle_s: float, ring_cpu_bytes: tuple[int, int] | None,
           codec_bytes: int, shared: bool, allreduce_bytes: int, backend: str) -> dict[str, Any]:
    """One rank of :func:`measure_setup`; rank 0 returns the Setup's fields. ``ring_cpu_bytes``: the
    two gradients our ring's CPU is timed at (None: not timed); ``codec_bytes``: the one it is timed at
    with each lossy codec too (0: none), and, where the workers share cores (``shared``), pipe-sgd's
    loop with each codec (:func:`~pipetrain.setup.ring.pipe_sgd_period`); ``allreduce_bytes``: the
    gradient the backend's allreduce is timed at beside 1 element."""
    torch.set_num_threads(threads)
    device = init_distributed(timeout, backend)
    rank = dist.get_rank()
    ratios, jitters, steps = sample_compute(workers, threads, kernel, seconds, compute_rounds, settle_s, rank, device)
    slowdown, step_s = (statistics.median(ratios) if workers > 1 else 1.0), statistics.median(steps)
    transport = Transport(rank, [(0, 1), (1, 0)], "rank {}".format, device, timeout)
    # CPU per message and our ring's CPU with nothing else running in the processes, and the backend's
    # allreduce after each rank's own training step; then the time per message and our ring's while a
    # thread of each computes, as a running job's compute does, and our ring once more with nothing running
    idle, cpu = ping_pong(transport, rank, rounds, device)
    # only a worker with under 2 cores pays its messages' CPU (Setup.shared_cpu)
    after_step = ping_pong(transport, rank, computing_rounds(step_s, rounds), device, kernel)[1] \
        if (os.cpu_count() or 1) < 2 * workers else [0.0, 0.0]
    one, allreduce_cpu = allreduce_at_sync(kernel, step_s, rank, 2 * rounds, device)
    whole = allreduce_at_sync(kernel, step_s, rank, 2 * rounds, device, allreduce_bytes)[0]
    world = dist.get_world_size()
    allreduce_latency = one / (2 * (world - 1))
    allreduce_per_byte = max(0.0, whole - one) / (2 * (world - 1) / world * allreduce_bytes)
    ring_cpu, ring_cpu_per_byte, plain_s = (0.0, 0.0, 0.0) if ring_cpu_bytes is None else \
        ring_cpu_line(device, ring_cpu_bytes)
    alone = {name: ring_alone(device, codec, codec_bytes) for name, codec in CODECS.items() if codec.lossy} \
        if codec_bytes else {}
    idle_ring = {"none": plain_s, **{name: s for name, (_, s) in alone.items()}} if codec_bytes else {}
    stop = threading.Event()
    load = threading.Thread(target=run_for, args=(kernel, 0.0, stop), daemon=True)
    load.start()
    latency, per_byte = fit_line(ping_pong(transport, rank, rounds, device)[0])
    sizes = ring_sizes(per_byte)  # rank 0's per_byte sizes it
    ring_latency, ring_per_byte = ring_line(rank, sizes, device, rounds)
    dist.barrier()  # the other ranks compute until the ring ends: every worker of the job is busy
    stop.set()
    load.join()
    dist.barrier()
    # only pipe-sgd, whose set-up times our ring's CPU, is priced with it
    idle_ring_latency, idle_ring_per_byte = (0.0, 0.0) if ring_cpu_bytes is None else \
        ring_line(rank, sizes, device, rounds)
    periods = {name: pipe_sgd_period(kernel, device, CODECS[name], codec_bytes, s)
               for name, s in idle_ring.items()} if shared else {}
    if rank != 0:
        return {}
    cpu_s, cpu_per_byte = fit_line(cpu)
    computing_cpu_s, computing_cpu_per_byte = fit_line(after_step)
    idle_latency = fit_line(idle)[0]
    return dict(backend=dist.get_backend(), workers=workers, threads=threads, cores=os.cpu_count() or 1,
                slowdown=max(1.0, slowdown), latency_s=latency, s_per_byte=per_byte, message_cpu_s=cpu_s,
                message_cpu_s_per_byte=cpu_per_byte, copy_s_per_byte=memory_s_per_byte(device, torch.Tensor.copy_),
                add_s_per_byte=memory_s_per_byte(device, torch.Tensor.add_),
                ring_latency_s=ring_latency, ring_s_per_byte=ring_per_byte, allreduce_latency_s=allreduce_latency,
                allreduce_s_per_byte=allreduce_per_byte, allreduce_bytes=allreduce_bytes,
                jitter_s=statistics.median(jitters), allreduce_cpu_s=allreduce_cpu, ring_cpu_s=ring_cpu,
                ring_cpu_s_per_byte=ring_cpu_per_byte, idle_latency_s=idle_latency, step_s=step_s,
                step_rows=kernel.rows if isinstance(kernel, ModelStep) else 0,
                codec_ring_cpu_s={name: cpu for name, (cpu, _) in alone.items()}, ring_cpu_bytes=codec_bytes,
                idle_ring_latency_s=idle_ring_latency, idle_ring_s_per_byte=idle_ring_per_byte,
                idle_ring_s=idle_ring, period_s=periods, computing_message_cpu_s=computing_cpu_s,
                computing_message_cpu_s_per_byte=computing_cpu_per_byte)
