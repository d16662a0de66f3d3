"""The PyTorch peers pipetrain is measured against, each one rank of a job (see
:mod:`pipetrain.bench.measure` for how they are launched and what they return): BSP data parallelism
with ``DistributedDataParallel``, the same workers with no sync at all, synchronous SGD through a
parameter server (PS-Sync), and a ``torch.distributed.pipelining`` pipeline.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from pipetrain.bench.measure import PeerConfig, batches, finish, init_group, timed_windows
from pipetrain.bench.stages import as_tuple, cut
from pipetrain.layers import LayeredModel, check_boundaries


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
    rank, world = init_group(cfg)
    model = DistributedDataParallel(cfg.build())
    if fp16:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    step, last_loss = _shard_sgd(cfg, model, rank, world)
    grad_bytes = sum(p.numel() * (2 if fp16 else p.element_size()) for p in model.parameters() if p.requires_grad)
    counted = 2 * (world - 1) / world * grad_bytes / cfg.batch_size
    out = timed_windows(cfg, step, counted, list(model.parameters()))
    out.update(runner="ddp-fp16" if fp16 else "ddp", loss=last_loss(), grad_bytes=grad_bytes)
    # [Note: DDP teardown] freed only as this function returned, after finish destroyed the process
    # group, DDP's reducer can hang its rank in its teardown: free it, and what holds it, while the
    # group lives.
    del model, step, last_loss
    gc.collect()
    return finish(out)


def _shard_sgd(cfg: PeerConfig, model: nn.Module, rank: int, world: int) -> tuple[Callable[[int], None],
                                                                                 Callable[[], float]]:
    """A data-parallel worker's SGD step on its ``batch_size / world`` shard, and its last loss.

    Raises:
        ValueError: ``batch_size`` is not divisible by the world size.
    """
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the {world} data-parallel workers")
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    minibatches = batches(cfg, cfg.batch_size // world, seed=cfg.seed + 1 + rank)
    loss = [torch.zeros(())]

    def step(i: int) -> None:
        x, y = minibatches[i % len(minibatches)]
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
    rank, world = init_group(cfg)
    model = cfg.build()
    step, last_loss = _shard_sgd(cfg, model, rank, world)
    out = timed_windows(cfg, step, 0.0, list(model.parameters()))
    out.update(runner="no-sync", loss=last_loss())
    return finish(out)


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
        :func:`~pipetrain.bench.measure.timed_windows`'s keys, ``runner="ps-sync"``, ``role`` (``"server"`` or ``"worker"``) and
        ``loss`` (the last step's on a worker, None on the server).

    Raises:
        ValueError: fewer than 2 ranks, or ``batch_size`` not divisible by the W workers.
    """
    rank, world = init_group(cfg)
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

        out = timed_windows(cfg, step, workers * weight_bytes / cfg.batch_size, [weights])
    else:
        minibatches = batches(cfg, cfg.batch_size // workers, seed=cfg.seed + 1 + rank)

        def step(i: int) -> None:
            nonlocal loss
            x, y = minibatches[i % len(minibatches)]
            loss = cfg.spec.loss_fn(model(x), y)
            dist.send(_flat(torch.autograd.grad(loss, params)), dst=server)
            dist.recv(weights, src=server)
            with torch.no_grad():
                for p, w in zip(params, weights.split([p.numel() for p in params])):
                    p.copy_(w.view_as(p))

        out = timed_windows(cfg, step, weight_bytes / cfg.batch_size, params)
    out.update(runner="ps-sync", role="server" if rank == server else "worker",
               loss=None if loss is None else float(loss.detach()))
    if return_weights:
        out["weights"] = weights if rank == server else _flat(params)
    return finish(out)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of ``tensors``, flattened and concatenated (p2p sends take one tensor)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble")
"""torch's schedules the bench runs: ``Schedule1F1B``, ``ScheduleGPipe`` (one stage per rank),
``ScheduleInterleaved1F1B`` (v stages per rank, looped) and ``ScheduleInterleavedZeroBubble`` (ZB1P: with
one stage per rank, zero bubble's ZB-H1; with v, looped)."""
LOOPED = ("interleaved-1f1b", "zero-bubble")


def local_stages(schedule: str, rank: int, world: int, n_stages: int) -> list[int]:
    """The stages ``rank`` holds: stage ``rank`` alone for a one-stage schedule; for a looped one ``rank``,
    ``rank + world``, ... (the placement of Megatron and torch).

    Raises:
        ValueError: a stage count this schedule cannot place on ``world`` ranks.
    """
    if schedule not in LOOPED:
        if n_stages != world:
            raise ValueError(f"{n_stages} stages but WORLD_SIZE is {world}; {schedule} runs one rank per stage")
        return [rank]
    if n_stages % world:
        raise ValueError(f"{n_stages} stages do not loop evenly over {world} ranks; give a multiple of {world}")
    return list(range(rank, n_stages, world))


def torch_pipeline(cfg: PeerConfig, stages: Sequence[int], microbatches: int = 4,
                   schedule: str = "1f1b") -> dict[str, Any]:
    """One rank of a ``torch.distributed.pipelining`` job with a flush every minibatch.

    The model is cut as pipetrain cuts it (:class:`pipetrain.layers.LayeredModel`; ``stages`` are the
    first layer indices) and each piece the rank holds (:func:`local_stages`) is wrapped in a
    ``PipelineStage`` given its input and output shapes, run by the schedule :data:`SCHEDULES` names.
    Counted bytes: per sample, the activations its stages send forward plus the input gradients they
    send back (p2p, sent once).

    Raises:
        ValueError: bad ``stages``, ``schedule`` or ``microbatches`` for this world size and batch.
    """
    # imported here, where a torch pipeline runs: it imports torch._dynamo, seconds that every `pipetrain`
    # command would pay otherwise (the CLI imports the bench)
    from torch.distributed.pipelining import (
        PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
    )

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    rank, world = init_group(cfg)
    bounds = [int(b) for b in stages]
    model = cfg.build()
    layers = LayeredModel(model)
    check_boundaries(bounds, len(layers))
    n = len(bounds)
    mine = local_stages(schedule, rank, world, n)
    if cfg.batch_size % microbatches:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by microbatches={microbatches}")
    if schedule != "gpipe" and microbatches < world:
        raise ValueError(f"{schedule} needs microbatches >= ranks ({world}); got {microbatches}")
    pieces = cut(layers, bounds)
    minibatches = batches(cfg, cfg.batch_size, seed=cfg.seed + 1)
    # Every rank holds the whole (small) model at first, so each can find its stages' shapes locally.
    mb = cfg.batch_size // microbatches
    shapes: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
    with torch.no_grad():
        value: Any = minibatches[0][0][:mb]
        for k, piece in enumerate(pieces):
            inputs = as_tuple(value)
            value = piece(*inputs)
            if k in mine:
                shapes[k] = inputs, as_tuple(value)
    # [Note: static stage metadata] PipelineStage copies requires_grad from these examples. Made under
    # no_grad they say no gradient crosses the cut: torch 2.13 then fails with an empty RuntimeError,
    # or, when some rank also lacks a loss_fn, skips the gradient sends and earlier stages never learn.
    held = []
    for k in mine:
        inputs = tuple(t.requires_grad_(k > 0 and t.is_floating_point()) for t in shapes[k][0])
        outputs = tuple(t.requires_grad_(t.is_floating_point()) for t in shapes[k][1])
        shapes[k] = inputs, outputs
        held.append(PipelineStage(pieces[k], k, n, torch.device("cpu"), input_args=inputs, output_args=outputs))
    cls: Any = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved-1f1b": ScheduleInterleaved1F1B,
                "zero-bubble": ScheduleInterleavedZeroBubble}[schedule]
    # Every rank passes loss_fn: a schedule without one runs forward only ("has_backward" is derived
    # from it), and the first stage would then never wait for gradients; with gloo, a hang.
    sched = cls(held if schedule in LOOPED else held[0], microbatches, loss_fn=cfg.spec.loss_fn)
    params = [p for k in mine for p in pieces[k].parameters()]
    opt = torch.optim.SGD(params, lr=cfg.lr)
    losses: list[torch.Tensor] = []
    first, last = 0 in mine, n - 1 in mine

    def step(i: int) -> None:
        x, y = minibatches[i % len(minibatches)]
        opt.zero_grad()
        losses.clear()
        sched.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}),
                   return_outputs=False)
        opt.step()

    def nbytes(ts: tuple[torch.Tensor, ...]) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    sent = sum((nbytes(shapes[k][1]) if k < n - 1 else 0) +
               (nbytes(tuple(t for t in shapes[k][0] if t.is_floating_point())) if k > 0 else 0) for k in mine)
    out = timed_windows(cfg, step, sent / mb, params)
    out.update(runner=f"torch-{schedule}", stages=bounds, microbatches=microbatches,
               loss=float(torch.stack(losses).detach().mean()) if losses else None,
               params=sum(p.numel() for p in params))
    return finish(out)
