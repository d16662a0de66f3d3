"""``pipetrain.train``: validate, start the workers (or join torchrun), gather the trained model."""
from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from pipetrain.layers import LayeredModel, check_boundaries
from pipetrain.planning import Plan, check_fits, plan
from pipetrain.profiling import profile_model
from pipetrain.runtime.job import JobConfig, describe, init_distributed, run_rank
from pipetrain.runtime.launch import PipetrainError, spawn, under_torchrun
from pipetrain.schedule import SCHEDULES


@dataclass
class TrainResult:
    """What a run gives back.

    Attributes:
        model: the trained full model, gathered from all stages, same structure as the input model.
        history: one record per optimizer step of the output stage: ``step``, ``epoch``, ``loss``,
            ``samples`` and ``samples_per_s`` (those samples over the time since the previous step),
            ``time`` (the output stage's perf_counter).
        samples_per_s: samples trained per second over the whole run, measured at the output stage.
        traces: per rank, ``(action, start, end)`` records when ``trace=True`` (perf_counter seconds).
        plan: the plan that placed the stages, when one did (``"auto"``, a Plan or a plan file).
        predicted_samples_per_s: the plan's prediction, batch size / its slowest stage's time.
        bytes_sent: per rank, tensor bytes it sent to other workers (activations, gradients, and its
            share of a replicated stage's allreduce, estimated as a ring's 2(r-1)/r).
        started: ``time.perf_counter()`` when ``train`` was called; on one machine it shares the clock
            of the history's ``time`` (so ``h["time"] - started`` is wall time since the call).
    """

    model: nn.Module
    history: list[dict[str, Any]]
    samples_per_s: float
    traces: list[list[tuple[str, float, float]]] = field(default_factory=list)
    plan: Plan | None = None
    predicted_samples_per_s: float | None = None
    started: float = 0.0
    bytes_sent: list[int] = field(default_factory=list)


def train(model: nn.Module, dataset: Dataset, *, loss_fn: Callable[[Any, Any], torch.Tensor],
          optimizer: Callable[..., torch.optim.Optimizer], stages: Sequence[int] | Plan | str | os.PathLike,
          workers: int | None = None, bandwidth: float | str = "10Gbit", schedule: str = "pipedream", vertical_sync: bool = False, batch_size: int = 32,
          microbatches: int = 1, epochs: int = 1, shuffle: bool = True, seed: int = 0,
          checkpoint_dir: str | os.PathLike | None = None, resume: bool = False,
          keep_checkpoints: int | None = 2, timeout: float = 300.0,
          threads: int | None = None, trace: bool | str | os.PathLike = False,
          progress: bool = False) -> TrainResult:
    """Train ``model`` on ``dataset`` as a pipeline, one worker process per stage.

    Args:
        model: an ``nn.Sequential`` or a ``torch.fx``-traceable module.
        dataset: a map-style dataset of ``(input, target)`` pairs.
        loss_fn: ``loss_fn(output, target)`` of a minibatch; mean-reduced for microbatching.
        optimizer: a factory taking parameters, e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``.
        stages: the first layer index of each stage (one worker each); or a ``Plan``, or a plan JSON
            path (``pipetrain plan -o``), which may replicate stages; or ``"auto"``: profile the model
            on the first minibatch and plan for ``workers`` at ``bandwidth`` (PipeDream §3.2).
        workers: the worker count for ``"auto"``; with a plan, it must match the plan's.
        bandwidth: link speed the automatic plan assumes, bytes/s or a string such as ``"10Gbit"``.
        schedule: ``pipedream``, ``naive``, ``gpipe``, ``1f1b-flush`` or ``model-parallel``.
        vertical_sync: with ``pipedream``, every stage uses the input stage's weight version.
        batch_size: samples per minibatch (one optimizer update).
        microbatches: slices per minibatch for ``gpipe`` and ``1f1b-flush``.
        epochs, shuffle, seed: passes over the data; with ``shuffle=False`` minibatch t (0-based)
            is items [t*B, (t+1)*B).
        checkpoint_dir: where each stage saves itself after every epoch; ``resume=True`` restarts
            from the newest epoch all stages completed; each worker keeps its ``keep_checkpoints``
            newest epochs (at least 2; None keeps all, e.g. to evaluate every epoch later with
            ``pipetrain.load_checkpoint``).
        timeout: seconds a worker waits on a silent peer before failing.
        threads: torch threads per worker (default: cores / workers).
        trace: record each action's start and end on every worker (``result.traces``); a directory
            also gets ``trace.json`` (Chrome trace, opens in Perfetto) and ``timeline.png``.
        progress: show a progress bar.

    Raises:
        ValueError: bad arguments (one line says which and what to do).
        PipetrainError: a worker failed; the message names it.
    """
    started = time.perf_counter()
    layers = LayeredModel(model)
    chosen = _resolve_plan(stages, workers, len(layers), model, dataset, loss_fn, batch_size, bandwidth,
                           _threads(threads, workers or 1), timeout)
    boundaries = chosen.boundaries if chosen else [int(b) for b in stages]  # type: ignore[union-attr]
    replicas = chosen.replicas if chosen else [1] * len(boundaries)
    check_boundaries(boundaries, len(layers))
    world = sum(replicas)
    _check_args(schedule, vertical_sync, batch_size, microbatches, epochs, len(dataset),  # type: ignore[arg-type]
                math.lcm(*replicas), checkpoint_dir, resume, keep_checkpoints)
    if vertical_sync and world != len(replicas):
        raise ValueError(f"vertical_sync needs one worker per stage; this plan replicates stages {replicas}")
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} workers but stages={boundaries} "
                         f"needs {world}; launch with --nproc-per-node/--nnodes giving {world} in all")
    cfg = JobConfig(model, dataset, loss_fn, optimizer, boundaries, replicas, schedule, vertical_sync,
                    batch_size, microbatches, epochs, shuffle, seed,
                    None if checkpoint_dir is None else str(checkpoint_dir), resume, keep_checkpoints, timeout,
                    _threads(threads, world),
                    bool(trace), progress)
    if under_torchrun():
        parts = run_rank(cfg)["parts"]
    else:
        parts = spawn(run_rank, world, (cfg,), describe=describe(replicas))
    result = _gather(model, parts)
    result.started = started
    if chosen is not None:
        result.plan = chosen
        result.predicted_samples_per_s = batch_size / chosen.stage_time_s if chosen.stage_time_s > 0 else None
    if trace and not isinstance(trace, bool) and int(os.environ.get("RANK", "0")) == 0:
        _write_trace(result.traces, Path(trace), describe(replicas), f"{schedule}, stages {boundaries}")
    return result


def _write_trace(traces: list[list[tuple[str, float, float]]], directory: Path, name: Callable[[int], str],
                 title: str) -> None:
    from pipetrain.trace import draw_timeline, write_chrome_trace

    directory.mkdir(parents=True, exist_ok=True)
    names = [name(r) for r in range(len(traces))]
    # local workers share the monotonic clock; under torchrun each host has its own origin
    start = min((t[0][1] for t in traces if t), default=0.0)
    offsets = None if under_torchrun() else [start] * len(traces)
    write_chrome_trace(traces, directory / "trace.json", names=names, offsets=offsets)
    draw_timeline(traces, directory / "timeline.png", title=f"{title}: measured", names=names, offsets=offsets)


def _threads(threads: int | None, workers: int) -> int:
    """Torch threads per worker: the cores of this machine shared by its workers, unless given."""
    if threads is not None:
        return threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", workers))
    return max(1, (os.cpu_count() or 1) // local)


def _resolve_plan(stages: Any, workers: int | None, num_layers: int, model: nn.Module, dataset: Dataset,
                  loss_fn: Callable[[Any, Any], torch.Tensor], batch_size: int, bandwidth: float | str,
                  threads: int, timeout: float) -> Plan | None:
    """The plan ``stages`` names (a Plan, a JSON path or "auto"), checked against the model; None
    for a plain list of boundaries."""
    if isinstance(stages, Plan):
        chosen, source = stages, "the plan"
    elif isinstance(stages, (str, os.PathLike)) and str(stages) == "auto":
        if workers is None:
            raise ValueError("stages='auto' needs workers=N (CLI: --workers N), the number of workers to plan for")
        chosen, source = _auto_plan(model, dataset, loss_fn, batch_size, workers, bandwidth, threads, timeout), "auto"
    elif isinstance(stages, (str, os.PathLike)):
        chosen, source = Plan.load(stages), str(stages)
    else:
        return None
    check_fits(chosen, num_layers, source)
    if workers is not None and chosen.workers != workers:
        raise ValueError(f"{source} places {chosen.workers} workers but workers={workers} was asked for; "
                         f"use {chosen.workers} or make a new plan with `pipetrain plan --workers {workers}`")
    return chosen


def _auto_plan(model: nn.Module, dataset: Dataset, loss_fn: Callable[[Any, Any], torch.Tensor],
               batch_size: int, workers: int, bandwidth: float | str, threads: int, timeout: float) -> Plan:
    """Profile on the first minibatch with the workers' thread count, then plan. Under torchrun,
    rank 0 plans and the others take its plan, so timing noise cannot split the job."""
    if under_torchrun():
        import torch.distributed as dist

        init_distributed(timeout)
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            box[0] = _profile_and_plan(model, dataset, loss_fn, batch_size, workers, bandwidth, threads).to_dict()
        dist.broadcast_object_list(box, src=0)
        return Plan.from_dict(box[0])
    return _profile_and_plan(model, dataset, loss_fn, batch_size, workers, bandwidth, threads)


def _profile_and_plan(model: nn.Module, dataset: Dataset, loss_fn: Callable[[Any, Any], torch.Tensor],
                      batch_size: int, workers: int, bandwidth: float | str, threads: int) -> Plan:
    x, y = default_collate([dataset[i] for i in range(min(batch_size, len(dataset)))])  # type: ignore[arg-type]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        measured = profile_model(model, (x, y), loss_fn, repeats=5, warmup=2)
    finally:
        torch.set_num_threads(before)
    return plan(measured, workers, bandwidth)


def _check_args(schedule: str, vertical_sync: bool, batch_size: int, microbatches: int, epochs: int,
                n_items: int, lcm: int, checkpoint_dir: Any, resume: bool, keep: int | None) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if vertical_sync and schedule != "pipedream":
        raise ValueError(f"vertical_sync applies to the 'pipedream' schedule, not {schedule!r}")
    if batch_size < 1 or microbatches < 1 or epochs < 1:
        raise ValueError(f"batch_size, microbatches and epochs must be >= 1 (got {batch_size}, "
                         f"{microbatches}, {epochs})")
    if batch_size % microbatches:
        raise ValueError(f"batch_size {batch_size} is not divisible by microbatches {microbatches}; "
                         "pick a batch size that splits evenly")
    if microbatches > 1 and schedule not in ("gpipe", "1f1b-flush"):
        raise ValueError(f"schedule {schedule!r} does not split minibatches; use microbatches=1 or "
                         "'gpipe' / '1f1b-flush'")
    if n_items < batch_size * lcm:
        raise ValueError(f"the dataset has {n_items} items, fewer than one round of minibatches "
                         f"({batch_size * lcm}); use a smaller batch_size")
    if keep is not None and keep < 2:
        raise ValueError(f"keep_checkpoints={keep}: keep at least 2 (a worker may be one epoch ahead of "
                         "another, so resuming needs the previous epoch) or None for all")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir (where the stages saved themselves)")


def _gather(model: nn.Module, parts: list[dict[str, Any]]) -> TrainResult:
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part["state"])
    full = copy.deepcopy(model)
    missing = set(full.state_dict()) - set(state)
    if missing:
        raise PipetrainError(f"no stage returned {sorted(missing)[:3]}; those tensors are not used in "
                             "forward, so no stage owns them")
    full.load_state_dict(state)
    history = sorted((h for part in parts for h in part["history"]), key=lambda h: h["step"])
    speed = 0.0
    if len(history) > 1 and history[-1]["time"] > history[0]["time"]:
        # history times are one process's clock: the output stage's (one replica of it)
        speed = sum(h["samples"] for h in history[1:]) / (history[-1]["time"] - history[0]["time"])
    return TrainResult(full, history, speed, [part["trace"] for part in parts],
                       bytes_sent=[part["bytes_sent"] for part in parts])
