"""What a run gives back: the trained model gathered from the workers, its history and its speed.

Every rank returns its part as plain data (state tensors, records); :func:`gather` puts them together
once, in the caller, so the launcher never needs to know which strategy ran.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PipetrainError
from pipetrain.planning import Plan
from pipetrain.runtime.launch import under_torchrun
from pipetrain.runtime.outcome import RankResult
from pipetrain.trace import draw_timeline, write_chrome_trace


@dataclass
class TrainResult:
    """What a run gives back.

    Attributes:
        model: the trained full model (gathered from all stages of a pipeline), same structure as the
            input model; None for a model built on the meta device, which is never gathered (``saved``
            says where ``save`` wrote it).
        history: one record per optimizer step of the output stage (of worker 0 for data parallelism,
            with the minibatch's loss: the mean over the workers' shards): ``step``, ``epoch``, ``loss``,
            ``samples`` and ``samples_per_s`` (those samples over the time since the previous step),
            ``time`` (the output stage's perf_counter), ``lr`` (the learning rate the update used) and
            ``eval`` (with ``eval_dataset``, on each epoch's last record: the mean ``loss`` and metrics).
        samples_per_s: samples trained per second, measured at the output stage: every epoch from its
            start to its last update, not the evaluation, checkpoints and bookkeeping between epochs
            (:func:`training_rate`).
        traces: per rank, ``(action, start, end)`` records when ``trace=True`` (perf_counter seconds).
        plan: the plan that placed the stages, when one did (``"auto"``, a Plan or a plan file).
        predicted_samples_per_s: what pipetrain predicted for this run: with ``stages="auto"`` (or
            ``strategy="auto"``) the simulated run from the measured profile and set-up; with a plan
            given, batch size / its slowest stage's time.
        bytes_sent: per rank, tensor bytes it sent to other workers (activations, gradients, and its
            share of an allreduce: counted for pipe-sgd's ring, estimated as a ring's 2(r-1)/r of the
            gradient for a replicated stage and DDP).
        sync_stats: per rank, what its gradient synchronizer measured or decided: pipe-sgd's
            ``ring_seconds`` (each ring allreduce on the communication thread), cgdp's ``chunks``
            (the chunk size of every iteration) and ``search`` (the run-time chunk search).
        started: ``time.perf_counter()`` when ``train`` was called; on one machine it shares the clock
            of the history's ``time`` (so ``h["time"] - started`` is wall time since the call).
        restarts: one record per automatic restart (``max_restarts``): ``attempt`` that failed,
            ``error``, ``resumed_after_epoch`` (None: from scratch), ``redone_steps`` (updates the
            failed attempt made after that epoch, trained again) and ``time`` (perf_counter, when
            the failure was seen).
        epochs_trained: epochs this call trained (0 when a resumed job had nothing left to train).
        choice: with ``strategy="auto"``: ``{"choice": NAME, "predictions": {NAME: samples/s}, "options",
            "skipped", "reason"}`` (:meth:`pipetrain.planning.choose.Choice.to_dict`).
        peak_memory: per rank, the worker process's peak resident memory (bytes).
        peak_device_memory: per rank training on a GPU, the most bytes of tensors it held there at once
            (``torch.cuda.max_memory_allocated``); 0 on the CPU.
        predicted_memory: per rank, the peak bytes pipetrain predicted before training
            (:func:`pipetrain.predict.memory.predict_memory`, read off the model's shapes on the meta
            device: weights, stashed versions, activations in flight, gradients, optimizer state, a
            synchronizer's gradient copies and, on the CPU, the worker process's baseline), to set
            beside :attr:`measured_memory`.
        stashed_bytes: per rank, the peaks of what it kept between forwards and backwards:
            ``activation_bytes`` (what autograd saved for the microbatches in flight, and their
            inputs; with ``recompute=True`` the inputs and one microbatch's activations during its
            rerun) and ``weight_bytes`` (stashed weight versions beside the live weights, and the copies of
            a tied parameter)
            (:mod:`pipetrain.runtime.footprint`).
        memory_traces: per rank with ``trace=True``, ``(time, activation bytes, weight bytes)`` at every
            change (perf_counter seconds); ``trace.json`` draws them as a counter track.
        weight_versions: per rank, the most distinct versions of its stage's weights it held at once (the
            live weights and the copies minibatches in flight ran at): 1 without weight stashing, at
            most 2 for ``2bw``.
        phases: seconds the call spent before training, by phase: ``capture_s`` (cutting the model
            into layers), with ``stages="auto"`` ``profile_s``, ``compile_s`` (with ``compile``: compiling
            the layers to profile them), ``setup_s`` (the run set-up's probes)
            and ``plan_s``; ``memory_s`` (predicting each worker's memory, and measuring the process
            baseline the first time); ``start_s`` (from starting
            the workers until each held its stage) and ``first_update_s`` (from then to the first
            update; with ``compile``, the workers' compiling is in it), these two where this call
            started the workers (not under torchrun); with
            ``save``, also what it spent after training, ``save_s``: from the last worker beginning to
            write its stage until the model was written.
        saved: where ``save`` wrote the trained model, or None.
    """

    model: nn.Module | None
    history: list[dict[str, Any]]
    samples_per_s: float
    traces: list[list[tuple[str, float, float]]] = field(default_factory=list)
    plan: Plan | None = None
    predicted_samples_per_s: float | None = None
    started: float = 0.0
    bytes_sent: list[int] = field(default_factory=list)
    sync_stats: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    epochs_trained: int = 0
    choice: dict[str, Any] | None = None
    peak_memory: list[int] = field(default_factory=list)
    stashed_bytes: list[dict[str, int]] = field(default_factory=list)
    memory_traces: list[list[tuple[float, int, int]]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    weight_versions: list[int] = field(default_factory=list)
    saved: str | None = None
    peak_device_memory: list[int] = field(default_factory=list)
    predicted_memory: list[int] = field(default_factory=list)

    @property
    def measured_memory(self) -> list[int]:
        """Per rank, the measured peak its predicted one stands beside: the GPU's figure where it trained on
        one (``peak_device_memory``), else its process's (``peak_memory``)."""
        return [gpu or cpu for gpu, cpu in zip(self.peak_device_memory, self.peak_memory)] \
            if self.peak_device_memory else list(self.peak_memory)


def training_rate(records: list[dict[str, Any]]) -> float:
    """Samples per second over the time the workers trained, from the records of the updates (as
    ``TrainResult.history`` holds them): each epoch from its start (its first update's time less that
    update's own interval) to its last update. The time between epochs, spent evaluating, saving
    checkpoints and gathering losses, is left out: it is not what a schedule's speed decides, and the
    simulator predicts the epochs alone. 0 without records."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for h in records:
        e = h["epoch"]
        start[e] = min(start.get(e, math.inf), h["time"] - h["samples"] / h["samples_per_s"])
        end[e] = max(end.get(e, -math.inf), h["time"])
    seconds = sum(end[e] - start[e] for e in start)
    return sum(h["samples"] for h in records) / seconds if seconds > 0 else 0.0


def gather(model: nn.Module | None, parts: list[RankResult], name: Callable[[int], str],
           since_epoch: int = 0) -> TrainResult:
    """The trained model (unless ``model`` is None: not gathered) and history from every rank's part
    (samples/s from the records of epochs ``since_epoch`` on: those trained by this run).
    Data-parallel workers must end bitwise identical: a difference is a bug, never a result."""
    full = _whole(model, parts) if model is not None else None
    differ = [p.rank for p in parts if not p.state and p.digest != parts[0].digest]
    if differ:
        raise PipetrainError(f"{name(differ[0])} ended with weights that differ from {name(0)}'s; data-parallel "
                             "workers must stay identical (please report this)")
    history = sorted((h for part in parts for h in part.history), key=lambda h: h["step"])
    speed = training_rate([h for h in history if h["epoch"] >= since_epoch])
    return TrainResult(full, history, speed, [part.trace for part in parts],
                       bytes_sent=[part.bytes_sent for part in parts],
                       sync_stats=[part.sync_stats for part in parts],
                       peak_memory=[part.peak_memory for part in parts],
                       peak_device_memory=[part.peak_device_memory for part in parts],
                       stashed_bytes=[part.stashed_bytes for part in parts],
                       memory_traces=[part.memory_trace for part in parts],
                       weight_versions=[part.weight_versions for part in parts])


def _whole(model: nn.Module, parts: list[RankResult]) -> nn.Module:
    """A copy of ``model`` holding the tensors the ranks returned."""
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part.state)
    full = copy.deepcopy(model)
    aliases: dict[int, list[str]] = {}  # a tied parameter's names; a stage may hold it under any of them
    for key, p in full.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(key)
    for names in aliases.values():
        held = next((state[k] for k in names if k in state), None)
        if held is not None:
            state.update({k: held for k in names if k not in state})
    missing = set(full.state_dict()) - set(state)
    if missing:
        raise PipetrainError(f"no stage returned {sorted(missing)[:3]}; those tensors are not used in "
                             "forward, so no stage owns them")
    full.load_state_dict(state)
    return full


def write_trace(traces: list[list[tuple[str, float, float]]], directory: Path, name: Callable[[int], str],
                title: str, memory: list[list[tuple[float, int, int]]] | None = None) -> None:
    """``trace.json`` (Chrome trace, opens in Perfetto) and ``timeline.png`` of a run's traces in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [name(r) for r in range(len(traces))]
    # local workers share the monotonic clock; under torchrun each host has its own origin
    start = min((t[0][1] for t in traces if t), default=0.0)
    offsets = None if under_torchrun() else [start] * len(traces)
    write_chrome_trace(traces, directory / "trace.json", names=names, offsets=offsets, memory=memory)
    draw_timeline(traces, directory / "timeline.png", title=f"{title}: measured", names=names, offsets=offsets)
