"""Runners for side-by-side benchmarks: pipetrain itself and its peers, PyTorch DDP,
``torch.distributed.pipelining`` and a parameter server (PS-Sync).

Each runner is one rank of a job, configured like torchrun: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT come from the environment. So the same function runs under
:func:`pipetrain.runtime.launch.spawn` on loopback, under :meth:`EmulatedCluster.spawn` (one rank per
namespace host), or under torchrun (``python -c`` calling it). Each trains a zoo model on synthetic
data and returns plain data (see :func:`_measure`):

* ``samples_per_s``: the median over timed windows of the job's samples per second, after warm-up
  steps; ``window_samples_per_s`` holds every window. Windows end with a barrier, so every rank
  reports the same job-wide rate.
* ``counted_bytes_per_sample``: bytes this worker sends per sample of the job, from the tensor sizes
  (see each runner for the formula). ``iface_bytes_per_sample``: the same read from the network
  interface's tx counter, when there is one per worker (``GLOO_SOCKET_IFNAME`` other than ``lo``, as in
  the emulated cluster); None on loopback, where every rank shares ``lo``.

A sample is one sample of the job's minibatch (``batch_size``, the samples of one optimizer update for
the whole job), so data-parallel and pipeline numbers compare directly.
"""
from __future__ import annotations

import datetime
import functools
import gc
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.bench.load import machine_busy_s
from pipetrain.layers import LayeredModel, check_boundaries
from pipetrain.trace import seconds_by_kind
from pipetrain.zoo import SPECS, ModelSpec


@dataclass
class PeerConfig:
    """What every peer runner trains and how it times it.

    Attributes:
        model: a :data:`pipetrain.zoo.SPECS` name.
        model_kwargs: the model factory's size knobs.
        batch_size: samples per optimizer update of the whole job (split across data-parallel workers,
            or into microbatches by a pipeline).
        warmup: untimed steps first (allocations, gloo connections, pipelining's shape exchange).
        windows: timed windows; the reported rate is their median.
        steps_per_window: optimizer steps per window.
        lr: SGD learning rate.
        seed: model initialisation and data.
        threads: torch threads per worker.
        timeout_s: how long a collective or p2p operation may wait on a peer.
        iface: network interface whose tx counter is read; default ``GLOO_SOCKET_IFNAME`` unless ``lo``.
    """

    model: str = "vgg-like"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    warmup: int = 2
    windows: int = 3
    steps_per_window: int = 2
    lr: float = 0.01
    seed: int = 0
    threads: int = 1
    timeout_s: float = 300.0
    iface: str | None = None

    def __post_init__(self) -> None:
        if self.model not in SPECS:
            raise ValueError(f"model={self.model!r} is not in the zoo; choose one of {sorted(SPECS)}")
        for name in ("batch_size", "windows", "steps_per_window", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be at least 0")

    @property
    def spec(self) -> ModelSpec:
        return SPECS[self.model]

    def build(self) -> nn.Module:
        """The model, initialised identically on every rank."""
        torch.manual_seed(self.seed)
        return self.spec.factory(**self.model_kwargs)


def ddp(cfg: PeerConfig, fp16: bool = False) -> dict[str, Any]:
    """One rank of BSP data parallelism with ``DistributedDataParallel`` over gloo.

    Each of the M workers takes ``batch_size / M`` samples per step; gradients are averaged by
    allreduce (gloo's ring for CPU tensors), optionally compressed to fp16 by DDP's
    ``fp16_compress_hook``. Counted bytes: a ring allreduce of G gradient bytes sends
    ``2 (M-1)/M * G`` per worker (Patarasuk and Yuan 2009), per step of ``batch_size`` samples; buffers
    DDP broadcasts (BatchNorm statistics) are left out.

    Raises:
        ValueError: ``batch_size`` is not divisible by the world size.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    rank, world = _init(cfg)
    model = DistributedDataParallel(cfg.build())
    if fp16:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    step, last_loss = _shard_sgd(cfg, model, rank, world)
    grad_bytes = sum(p.numel() * (2 if fp16 else p.element_size()) for p in model.parameters() if p.requires_grad)
    counted = 2 * (world - 1) / world * grad_bytes / cfg.batch_size
    out = _measure(cfg, step, counted, list(model.parameters()))
    out.update(runner="ddp-fp16" if fp16 else "ddp", loss=last_loss(), grad_bytes=grad_bytes)
    # freed only as this function returned, after _finish destroyed the process group, DDP's reducer
    # now and then hung its rank in its teardown (tests/test_peers.py::test_ddp, two jobs each: 5 of 42
    # runs hung, one of them in CI; freed here first, 0 of 84): free it, and what holds it, while the
    # group lives
    del model, step, last_loss
    gc.collect()
    return _finish(out)


def _shard_sgd(cfg: PeerConfig, model: nn.Module, rank: int, world: int) -> tuple[Callable[[int], None],
                                                                                 Callable[[], float]]:
    """A data-parallel worker's SGD step on its ``batch_size / world`` shard, and its last loss.

    Raises:
        ValueError: ``batch_size`` is not divisible by the world size.
    """
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the {world} data-parallel workers")
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    batches = _batches(cfg, cfg.batch_size // world, seed=cfg.seed + 1 + rank)
    loss = [torch.zeros(())]

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        loss[0] = cfg.spec.loss_fn(model(x), y)
        loss[0].backward()
        opt.step()
    return step, lambda: float(loss[0].detach())


def no_sync(cfg: PeerConfig) -> dict[str, Any]:
    """One rank training its ``batch_size / M`` shard with no gradient sync at all: a data-parallel
    worker's work with the machine shared as in a real job, but nothing exchanged. Subtracted from a
    data-parallel system's step time, it leaves the synchronisation's cost without the CPU contention
    between workers (the group only closes the timed windows). Counted bytes: 0."""
    rank, world = _init(cfg)
    model = cfg.build()
    step, last_loss = _shard_sgd(cfg, model, rank, world)
    out = _measure(cfg, step, 0.0, list(model.parameters()))
    out.update(runner="no-sync", loss=last_loss())
    return _finish(out)


def ps_sync(cfg: PeerConfig, return_weights: bool = False) -> dict[str, Any]:
    """One rank of synchronous SGD through a parameter server (PS-Sync, Pipe-SGD §4, arXiv:1811.03619).

    The job has W workers and one server, the last rank (on the emulated cluster an extra host, as
    the paper adds "an additional node as the parameter server"). Each step every worker computes the
    gradient of its ``batch_size / W`` samples and sends it to the server as one flat tensor; the
    server averages the W gradients, takes an SGD step on its copy of the weights and sends the new
    flat weights back to every worker, which copy them into its model. Point-to-point only, no
    collective. Every rank starts from the same weights (``cfg.build``); buffers (BatchNorm
    statistics) stay local to each worker, as the server keeps parameters only.

    Counted bytes per sample of the job: a worker sends its gradient, G bytes per step; the server
    sends the weights to every worker, W * G per step (the busiest link, the bottleneck).

    Args:
        cfg: what to train; the data shards are :func:`ddp`'s.
        return_weights: also return ``weights``, this rank's final flat weights (a float tensor).

    Returns:
        :func:`_measure`'s keys, ``runner="ps-sync"``, ``role`` (``"server"`` or ``"worker"``) and
        ``loss`` (the last step's on a worker, None on the server).

    Raises:
        ValueError: fewer than 2 ranks, or ``batch_size`` not divisible by the W workers.
    """
    rank, world = _init(cfg)
    workers, server = world - 1, world - 1
    if workers < 1:
        raise ValueError(f"ps-sync needs WORLD_SIZE >= 2 (workers + 1 parameter server); got {world}")
    if cfg.batch_size % workers:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the {workers} ps-sync workers "
                         "(the server takes no samples)")
    model = cfg.build()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = _flat(params)
    weight_bytes = weights.numel() * weights.element_size()
    loss: torch.Tensor | None = None
    if rank == server:
        grads = [torch.empty_like(weights) for _ in range(workers)]

        def step(i: int) -> None:
            for req in [dist.irecv(g, src=w) for w, g in enumerate(grads)]:
                assert req is not None  # None only on a rank outside the group
                req.wait()
            weights.sub_(torch.stack(grads).mean(0), alpha=cfg.lr)
            for req in [dist.isend(weights, dst=w) for w in range(workers)]:
                assert req is not None
                req.wait()

        out = _measure(cfg, step, workers * weight_bytes / cfg.batch_size, [weights])
    else:
        batches = _batches(cfg, cfg.batch_size // workers, seed=cfg.seed + 1 + rank)

        def step(i: int) -> None:
            nonlocal loss
            x, y = batches[i % len(batches)]
            loss = cfg.spec.loss_fn(model(x), y)
            dist.send(_flat(torch.autograd.grad(loss, params)), dst=server)
            dist.recv(weights, src=server)
            with torch.no_grad():
                for p, w in zip(params, weights.split([p.numel() for p in params])):
                    p.copy_(w.view_as(p))

        out = _measure(cfg, step, weight_bytes / cfg.batch_size, params)
    out.update(runner="ps-sync", role="server" if rank == server else "worker",
               loss=None if loss is None else float(loss.detach()))
    if return_weights:
        out["weights"] = weights if rank == server else _flat(params)
    return _finish(out)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of ``tensors``, flattened and concatenated (p2p sends take one tensor)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


SCHEDULES = ("1f1b", "gpipe")


def torch_pipeline(cfg: PeerConfig, stages: Sequence[int], microbatches: int = 4,
                   schedule: str = "1f1b") -> dict[str, Any]:
    """One rank (= one stage) of a ``torch.distributed.pipelining`` job with a flush every minibatch.

    The model is cut as pipetrain cuts it (:class:`pipetrain.layers.LayeredModel`; ``stages`` are the
    first layer indices, one stage per rank) and each piece wrapped in a ``PipelineStage`` given its
    input and output shapes, run by ``Schedule1F1B`` or ``ScheduleGPipe``. Counted bytes: per sample,
    the activations a stage sends forward plus the input gradients it sends back (p2p, sent once).

    Raises:
        ValueError: bad ``stages``, ``schedule`` or ``microbatches`` for this world size and batch.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    rank, world = _init(cfg)
    bounds = [int(b) for b in stages]
    model = cfg.build()
    layers = LayeredModel(model)
    check_boundaries(bounds, len(layers))
    if len(bounds) != world:
        raise ValueError(f"stages={bounds} has {len(bounds)} stages but WORLD_SIZE is {world}; "
                         "one rank per stage")
    if cfg.batch_size % microbatches:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by microbatches={microbatches}")
    if schedule == "1f1b" and microbatches < world:
        raise ValueError(f"1f1b needs microbatches >= stages ({world}); got {microbatches}")
    pieces = [_Splat(s, layers.takes_tuple(b)) for s, b in zip(layers.stages(bounds), bounds)]
    batches = _batches(cfg, cfg.batch_size, seed=cfg.seed + 1)
    # Every rank holds the whole (small) model at first, so each can find its stage's shapes locally.
    mb = cfg.batch_size // microbatches
    with torch.no_grad():
        value: Any = batches[0][0][:mb]
        for piece in pieces[:rank]:
            value = piece(*_as_tuple(value))
        inputs = _as_tuple(value)
        outputs = _as_tuple(pieces[rank](*inputs))
    # [Note: static stage metadata] PipelineStage copies requires_grad from these examples. Made under
    # no_grad they say no gradient crosses the cut: torch 2.13 then fails with an empty RuntimeError,
    # or, when some rank also lacks a loss_fn, skips the gradient sends and earlier stages never learn.
    inputs = tuple(t.requires_grad_(rank > 0 and t.is_floating_point()) for t in inputs)
    outputs = tuple(t.requires_grad_(t.is_floating_point()) for t in outputs)
    stage = PipelineStage(pieces[rank], rank, world, torch.device("cpu"), input_args=inputs,
                          output_args=outputs)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    # Every rank passes loss_fn: a schedule without one runs forward only ("has_backward" is derived
    # from it), and the first stage would then never wait for gradients; with gloo, a hang.
    sched = cls(stage, microbatches, loss_fn=cfg.spec.loss_fn)
    opt = torch.optim.SGD(pieces[rank].parameters(), lr=cfg.lr)
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        losses.clear()
        if rank == 0:
            sched.step(x, return_outputs=False)
        elif rank == world - 1:
            sched.step(target=y, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        opt.step()

    def nbytes(ts: tuple[torch.Tensor, ...]) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    sent_forward = nbytes(outputs) if rank < world - 1 else 0
    sent_back = nbytes(tuple(t for t in inputs if t.is_floating_point())) if rank > 0 else 0
    out = _measure(cfg, step, (sent_forward + sent_back) / mb, list(pieces[rank].parameters()))
    out.update(runner=f"torch-{schedule}", stages=bounds, microbatches=microbatches,
               loss=float(torch.stack(losses).detach().mean()) if losses else None,
               params=sum(p.numel() for p in pieces[rank].parameters()))
    return _finish(out)


def pipetrain_job(cfg: PeerConfig, runner: str, options: dict[str, Any], trace: bool = False) -> dict[str, Any]:
    """One rank of a ``pipetrain.train`` job, timed from the job's own history.

    The job trains one epoch of ``max(1, warmup) + windows * steps_per_window + 1`` minibatches (whole
    rounds of a replicated plan's), in
    order, on the same synthetic data and SGD as the peers. [Note: timing pipetrain from its history]
    ``train`` returns only after gathering the trained model to every rank (the whole model crosses the
    network once more), so a timer around the call would count that. Instead the windows are cut from
    ``result.history``, where ``time`` is when the output stage finished each optimizer step: window k
    runs from the end of step ``warmup + k * steps_per_window - 1`` to the end of its last step. The
    final minibatch is left out, as the pipeline drains there.

    Args:
        cfg: model, batch size, windows, threads; ``warmup`` counts minibatches (at least 1, whose
            end starts the first window).
        runner: the system's name in the report.
        options: ``pipetrain.train``'s options for this system (the world size is ``workers``): a
            pipeline's ``schedule``, ``stages`` (first layers, or ``"auto"``: profile on rank 0 and
            plan for the world size at ``bandwidth``, e.g. ``"1gbit"``), ``microbatches``; or a
            data-parallel ``strategy`` with its ``staleness`` and ``compression``.
        trace: also return ``breakdown``: per rank, seconds per minibatch each action kind took inside
            the windows: ``F``, ``B``, ``U`` compute (the forward includes taking a weight stash, the
            backward handing its gradient to the live weights), ``RF``/``RB`` waiting for a neighbour,
            ``SF``/``SB`` queueing a send.

    Returns:
        The keys :func:`_measure` returns (counted bytes: ``result.bytes_sent`` of this rank over every
        sample trained; interface bytes: the tx counter, sampled by a thread and read at the first and
        last window edge), and ``stages``, ``replicas``, ``plan``, ``predicted_samples_per_s`` (None
        for data parallelism), ``ring_s`` (pipe-sgd: the median seconds of its ring allreduces),
        ``chunks`` and ``search`` (cgdp: the chunk size of every iteration and the search's outcome;
        with ``chunk="auto"`` the warm-up lasts until the search is surely over).
    """
    import pipetrain

    # [Note: torchrun path under the local launcher] launch.spawn marks its children so that
    # pipetrain.train skips the final all_gather; a benchmark rank is a torchrun-style rank whose
    # caller needs the history on every rank, so drop the mark before train reads it.
    os.environ.pop("PIPETRAIN_SPAWNED", None)
    warmup = max(1, cfg.warmup)
    if options.get("strategy") == "cgdp" and options.get("chunk", "auto") == "auto":
        # the windows come after the run-time chunk search (it skips the first iteration)
        from pipetrain.strategies.cgdp import layer_parameters
        from pipetrain.strategies.chunks import search_length
        warmup = max(warmup, search_length(len(layer_parameters(cfg.build()))) + 1)
    steps = warmup + cfg.windows * cfg.steps_per_window + 1
    plan = options.get("stages")
    replicas = getattr(plan, "replicas", None) if plan != "auto" else range(1, int(os.environ["WORLD_SIZE"]) + 1)
    if replicas is not None:  # replicated stages train whole rounds of minibatches
        every = math.lcm(*replicas)
        steps = -(-steps // every) * every
    data = cfg.spec.dataset(steps * cfg.batch_size, seed=cfg.seed + 1)
    iface = cfg.iface or os.environ.get("GLOO_SOCKET_IFNAME")
    sampler = _TxSampler(iface) if iface and iface != "lo" else None
    if options.get("strategy", "pipeline") != "pipeline" or options.get("stages") == "auto":
        options = {**options, "workers": int(os.environ["WORLD_SIZE"])}  # explicit stages place the workers
    try:
        result = pipetrain.train(
            cfg.build(), data, loss_fn=cfg.spec.loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=cfg.lr),
            batch_size=cfg.batch_size, epochs=1, shuffle=False,
            seed=cfg.seed, timeout=cfg.timeout_s, threads=cfg.threads, trace=trace, **options)
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
    }
    if trace:
        out["breakdown"] = [{k: v / (cfg.windows * spw) for k, v in seconds_by_kind(t, edges[0], edges[-1]).items()}
                            for t in result.traces]
    return out


def ring_cost(cfg: PeerConfig, codec: str | None, repeats: int = 5) -> dict[str, Any]:
    """One rank of pipetrain's ring allreduce of the model's whole gradient alone, without training:
    what one allreduce costs this rank in wall seconds and in CPU seconds of the whole process (the
    copy of the gradient into the ring's buffer, the ring's arithmetic, gloo's threads and the
    kernel's network work done in its calls; ``resource``'s user + system time; ``machine_busy_s``:
    the whole machine's busy CPU seconds meanwhile), and ``latency_s``: one hop of a ring of one
    granule per rank (α of Pipe-SGD's eq. 5: the fixed cost of a message, Python and gloo included).
    Medians of ``repeats`` after one warm-up. Inputs of the data-parallel predictions
    (:func:`pipetrain.simulate.predict_data_parallel`'s ``comm_cpu_s`` and the link latency),
    measured on the same hosts and link as the runs they predict."""
    import resource

    from pipetrain.strategies.compression import get_codec
    from pipetrain.strategies.ring import block_size, ring_allreduce

    rank, world = _init(cfg)
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
        ring_allreduce(blocks, group, chosen, held)
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
        ring_allreduce(tiny, group, chosen)
        hops.append((time.perf_counter() - t0) / (2 * (world - 1)))
    return _finish({"rank": rank, "codec": codec, "elements": elements, "wall_s": statistics.median(walls[1:]),
                    "cpu_s": statistics.median(cpus[1:]), "machine_busy_s": statistics.median(machine[1:]),
                    "latency_s": statistics.median(hops[1:])})


class _TxSampler:
    """A network interface's tx byte counter, read every ``interval_s`` by a thread, with the time.

    Lets a job be measured inside windows that are known only afterwards (pipetrain's history).
    Times are ``time.perf_counter`` (CLOCK_MONOTONIC, shared by every process on one machine).
    """

    def __init__(self, iface: str, interval_s: float = 0.005) -> None:
        self._file = Path("/sys/class/net") / iface / "statistics" / "tx_bytes"
        self._interval = interval_s
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()
        self._read()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pipetrain-tx-sampler")
        self._thread.start()

    def _read(self) -> None:
        self.samples.append((time.perf_counter(), int(self._file.read_text())))

    def _loop(self) -> None:
        while not self._done.wait(self._interval):
            self._read()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._read()

    def at(self, t: float) -> float:
        """The counter at time ``t``, interpolated linearly between the samples around it."""
        for (t0, b0), (t1, b1) in zip(self.samples, self.samples[1:]):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else float(b1)
        return float(self.samples[0][1] if t < self.samples[0][0] else self.samples[-1][1])


class _Splat(nn.Module):
    """A stage called as ``stage(*tensors)`` (PipelineStage's convention) around one taking one value or,
    if ``takes_tuple`` (:meth:`pipetrain.layers.LayeredModel.takes_tuple`), a tuple, even of one tensor."""

    def __init__(self, inner: nn.Module, takes_tuple: bool) -> None:
        super().__init__()
        self.inner, self.takes_tuple = inner, takes_tuple

    def forward(self, *xs: torch.Tensor) -> Any:
        out = self.inner(xs if self.takes_tuple or len(xs) > 1 else xs[0])
        # torch's p2p sends need contiguous tensors; a stage may end in a view (a transpose, say).
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()


def _as_tuple(v: Any) -> tuple[torch.Tensor, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _init(cfg: PeerConfig) -> tuple[int, int]:
    torch.set_num_threads(cfg.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _batches(cfg: PeerConfig, n: int, seed: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few synthetic minibatches to cycle through (made up front: data loading is not measured)."""
    x, y = cfg.spec.dataset(n * count, seed=seed)[:]
    return [(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n]) for i in range(count)]


def _tx_bytes(cfg: PeerConfig) -> int | None:
    iface = cfg.iface or os.environ.get("GLOO_SOCKET_IFNAME")
    if not iface or iface == "lo":
        return None
    f = Path("/sys/class/net") / iface / "statistics" / "tx_bytes"
    return int(f.read_text()) if f.exists() else None


def _measure(cfg: PeerConfig, step: Callable[[int], None], counted_bytes_per_sample: float,
             params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Warm up, then time ``cfg.windows`` windows of steps, each closed by a barrier.

    Also reports ``update_norm``, how far this worker's ``params`` moved: zero means it never learned.
    """
    before = [p.detach().clone() for p in params]
    i = 0
    for _ in range(cfg.warmup):
        step(i)
        i += 1
    dist.barrier()
    tx0 = _tx_bytes(cfg)
    rates = []
    for _ in range(cfg.windows):
        t0 = time.perf_counter()
        for _ in range(cfg.steps_per_window):
            step(i)
            i += 1
        dist.barrier()
        rates.append(cfg.steps_per_window * cfg.batch_size / (time.perf_counter() - t0))
    tx1 = _tx_bytes(cfg)
    timed_samples = cfg.windows * cfg.steps_per_window * cfg.batch_size
    return {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "model": cfg.model,
        "batch_size": cfg.batch_size, "threads": cfg.threads,
        "samples_per_s": statistics.median(rates), "window_samples_per_s": rates,
        "counted_bytes_per_sample": float(counted_bytes_per_sample),
        "iface_bytes_per_sample": None if tx0 is None or tx1 is None else (tx1 - tx0) / timed_samples,
        "update_norm": float(sum(((p.detach() - b) ** 2).sum() for p, b in zip(params, before)) ** 0.5),
    }


def _finish(out: dict[str, Any]) -> dict[str, Any]:
    dist.barrier()
    dist.destroy_process_group()
    return out


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One job's numbers from its ranks' results: the job rate and per-worker bytes per sample.

    Every rank reports the same job-wide rate; bytes are per rank. What :func:`pipetrain_job` adds
    about the placement (``stages``, ``replicas``, ``plan``, ``predicted_samples_per_s``,
    ``breakdown``) is the same on every rank and passes through.
    """
    first = results[0]
    return {
        "runner": first["runner"], "model": first["model"], "world": first["world"],
        "samples_per_s": first["samples_per_s"], "window_samples_per_s": first["window_samples_per_s"],
        "counted_bytes_per_sample": [r["counted_bytes_per_sample"] for r in results],
        "iface_bytes_per_sample": [r["iface_bytes_per_sample"] for r in results],
        **{k: first[k] for k in ("stages", "replicas", "plan", "predicted_samples_per_s", "breakdown", "ring_s",
                                 "chunks", "search")
           if k in first},
    }
