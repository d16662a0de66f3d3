"""pipetrain itself as a benchmark runner, one rank of a job (see :mod:`pipetrain.bench.measure`):
a ``pipetrain.train`` job timed from its own history, and the cost of Pipe-SGD's allreduce alone
(an input of the data-parallel predictions)."""
from __future__ import annotations

import functools
import math
import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.registry import CGDP, from_options
from pipetrain.bench.load import machine_busy_s
from pipetrain.bench.measure import PeerConfig, TxSampler, finish, init_group
from pipetrain.strategies.cgdp import layer_parameters
from pipetrain.strategies.chunks import search_length
from pipetrain.strategies.compression import get_codec
from pipetrain.strategies.ring import allreduce, block_size
from pipetrain.trace import seconds_by_kind


def pipetrain_job(cfg: PeerConfig, runner: str, options: dict[str, Any], trace: bool = False) -> dict[str, Any]:
    """One rank of a ``pipetrain.train`` job, timed from the job's own history.

    The job trains one epoch of ``max(1, warmup) + windows * steps_per_window + 1`` minibatches (whole
    rounds of a replicated plan's), in order, on the same synthetic data and SGD as the peers.

    [Note: timing pipetrain from its history] ``train`` returns only after gathering the trained model to every rank (the whole model crosses the
    network once more), so a timer around the call would count that. Instead the windows are cut from
    ``result.history``, where ``time`` is when the output stage finished each optimizer step: window k
    runs from the end of step ``warmup + k * steps_per_window - 1`` to the end of its last step. The
    final minibatch is left out, as the pipeline drains there.

    Args:
        cfg: model, batch size, windows, threads; ``warmup`` counts minibatches (at least 1, whose
            end starts the first window).
        runner: the system's name in the report.
        options: this system's strategy, schedule and their options by name, as the CLI's flags give
            them (:func:`pipetrain.registry.from_options` makes the objects): a pipeline's
            ``schedule`` and ``microbatches``, or a data-parallel ``strategy`` with its ``staleness``
            and ``compression``; and where the workers go: ``stages`` (first layers, or ``"auto"``:
            profile on rank 0 and plan for the world size at ``bandwidth``, e.g. ``"1gbit"``).
        trace: also return ``breakdown``: per rank, seconds per minibatch each action kind took inside
            the windows: ``F``, ``B``, ``U`` compute (the forward includes taking a weight stash, the
            backward handing its gradient to the live weights), ``RF``/``RB`` waiting for a neighbour,
            ``SF``/``SB`` queueing a send.

    Returns:
        The keys :func:`pipetrain.bench.measure.timed_windows` returns (counted bytes: ``result.bytes_sent`` of this rank over every
        sample trained; interface bytes: the tx counter, sampled by a thread and read at the first and
        last window edge), and ``stages``, ``replicas``, ``plan``, ``predicted_samples_per_s`` (None
        for data parallelism), ``ring_s`` (pipe-sgd: the median seconds of its ring allreduces),
        ``chunks`` and ``search`` (cgdp: the chunk size of every iteration and the search's outcome;
        with ``chunk="auto"`` the warm-up lasts until the search is surely over).
    """
    # [Note: torchrun path under the local launcher] launch.spawn marks its children so that
    # pipetrain.train skips the final all_gather; a benchmark rank is a torchrun-style rank whose
    # caller needs the history on every rank, so drop the mark before train reads it.
    os.environ.pop("PIPETRAIN_SPAWNED", None)
    strategy, schedule = from_options(**{"strategy": "pipeline", **{
        k: v for k, v in options.items() if k not in ("stages", "bandwidth") and (k, v) != ("microbatches", 1)}})
    warmup = max(1, cfg.warmup)
    if isinstance(strategy, CGDP) and strategy.chunk == "auto":
        # the windows come after the run-time chunk search (it skips the first iteration)
        warmup = max(warmup, search_length(len(layer_parameters(cfg.build()))) + 1)
    steps = warmup + cfg.windows * cfg.steps_per_window + 1
    plan = options.get("stages")
    replicas = getattr(plan, "replicas", None) if plan != "auto" else range(1, int(os.environ["WORLD_SIZE"]) + 1)
    if replicas is not None:  # replicated stages train whole rounds of minibatches
        every = math.lcm(*replicas)
        steps = -(-steps // every) * every
    data = cfg.spec.dataset(steps * cfg.batch_size, seed=cfg.seed + 1)
    iface = cfg.interface()
    sampler = TxSampler(iface) if iface else None
    layout: dict[str, Any] = {k: options[k] for k in ("stages", "bandwidth") if k in options}
    if options.get("strategy", "pipeline") != "pipeline" or options.get("stages") == "auto" or \
            (schedule is not None and schedule.looped):
        layout["workers"] = int(os.environ["WORLD_SIZE"])  # explicit stages place the workers
    try:
        result = pipetrain.train(
            cfg.build(), data, loss_fn=cfg.spec.loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=cfg.lr),
            strategy=strategy, schedule=schedule, batch_size=cfg.batch_size, epochs=1, shuffle=False,
            seed=cfg.seed, timeout=cfg.timeout_s, threads=cfg.threads, trace=trace, **layout)
    finally:
        if sampler:
            sampler.stop()
    times = [h["time"] for h in result.history]
    if len(times) != steps:
        raise RuntimeError(f"pipetrain recorded {len(times)} optimizer steps, expected {steps}")
    spw = cfg.steps_per_window
    edges = [times[warmup - 1 + k * spw] for k in range(cfg.windows + 1)]
    rates = [sum(h["samples"] for h in result.history[warmup + k * spw:warmup + (k + 1) * spw]) / (b - a)
             for k, (a, b) in enumerate(zip(edges, edges[1:]))]
    timed = cfg.windows * spw * cfg.batch_size
    rank = int(os.environ["RANK"])
    assert result.model is not None  # the bench's models have real weights: gathered
    with torch.no_grad():
        moved = sum(float(((p - q) ** 2).sum()) for p, q in zip(result.model.parameters(), cfg.build().parameters()))
    stages = options.get("stages")
    out: dict[str, Any] = {
        "runner": runner, "rank": rank, "world": int(os.environ["WORLD_SIZE"]), "model": cfg.model,
        "batch_size": cfg.batch_size, "threads": cfg.threads, "microbatches": options.get("microbatches", 1),
        "samples_per_s": statistics.median(rates), "window_samples_per_s": rates,
        "counted_bytes_per_sample": result.bytes_sent[rank] / (steps * cfg.batch_size),
        "iface_bytes_per_sample": (sampler.at(edges[-1]) - sampler.at(edges[0])) / timed if sampler else None,
        "update_norm": moved ** 0.5, "loss": result.history[-1]["loss"],
        "stages": result.plan.boundaries if result.plan else None if stages is None else [int(b) for b in stages],
        "replicas": result.plan.replicas if result.plan else None if stages is None else [1] * len(stages),
        "plan": result.plan.to_dict() if result.plan else None,
        "predicted_samples_per_s": result.predicted_samples_per_s,
        "ring_s": statistics.median(rings) if (rings := result.sync_stats[rank].get("ring_seconds")) else None,
        "chunks": result.sync_stats[rank].get("chunks"), "search": result.sync_stats[rank].get("search"),
        "weight_versions": result.weight_versions,
    }
    if trace:
        out["breakdown"] = [{k: v / (cfg.windows * spw) for k, v in seconds_by_kind(t, edges[0], edges[-1]).items()}
                            for t in result.traces]
    return out


def ring_cost(cfg: PeerConfig, codec: str | None, repeats: int = 5) -> dict[str, Any]:
    """One rank of Pipe-SGD's allreduce (:func:`pipetrain.strategies.ring.allreduce`) of the model's
    whole gradient alone, without training: what one allreduce costs this rank in wall seconds and in CPU seconds of the whole process (the
    copy of the gradient into the ring's buffer, the ring's arithmetic, gloo's threads and the
    kernel's network work done in its calls; ``resource``'s user + system time; ``machine_busy_s``:
    the whole machine's busy CPU seconds meanwhile), and ``latency_s``: one hop of a ring of one
    granule per rank (α of Pipe-SGD's eq. 5: the fixed cost of a message, Python and gloo included).
    Medians of ``repeats`` after one warm-up. Inputs of the data-parallel predictions
    (:func:`pipetrain.predict.predict_data_parallel`'s ``comm_cpu_s`` and the link latency),
    measured on the same hosts and link as the runs they predict."""
    rank, world = init_group(cfg)
    elements = sum(p.numel() for p in cfg.build().parameters() if p.requires_grad)
    chosen = get_codec(codec)
    b = block_size(elements, world, chosen.granule)
    group = dist.new_group(list(range(world)))
    walls, cpus, machine = [], [], []
    grad, blocks = torch.randn(elements), torch.zeros(world, b)
    held: dict[str, torch.Tensor] = {}  # as pipe-sgd's ring keeps its buffers
    for _ in range(repeats + 1):
        dist.barrier()
        t0, u0, m0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), machine_busy_s()
        blocks.view(-1)[:elements].copy_(grad)  # what pipe-sgd's A action does
        allreduce(blocks, group, chosen, held)
        dist.barrier()
        u1, m1 = resource.getrusage(resource.RUSAGE_SELF), machine_busy_s()
        walls.append(time.perf_counter() - t0)
        cpus.append(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime)
        machine.append(m1 - m0)
    tiny = torch.zeros(world, chosen.granule)
    hops = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        allreduce(tiny, group, chosen)
        hops.append((time.perf_counter() - t0) / (2 * (world - 1)))
    return finish({"rank": rank, "codec": codec, "elements": elements, "wall_s": statistics.median(walls[1:]),
                   "cpu_s": statistics.median(cpus[1:]), "machine_busy_s": statistics.median(machine[1:]),
                   "latency_s": statistics.median(hops[1:])})
