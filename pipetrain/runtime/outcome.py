"""What one rank reports when it has trained: the caller puts every rank's together
(:func:`pipetrain.result.gather`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RankResult:
    """One rank's report. It travels as plain data (``dataclasses.asdict``, read back with
    ``torch.load(weights_only=True)``), so every field is a tensor, number, string, list or dict.

    Attributes:
        rank: the rank.
        state: the trained tensors it returns, by the model's names: its stages' (pipeline), the whole
            model's (data-parallel rank 0), or none (other data-parallel ranks; a model built on the
            meta device, which is never gathered).
        digest: data parallelism: a hash of its weights (every worker's must be equal); else None.
        history: its :class:`~pipetrain.runtime.worker.StepRecord` s, where it holds the output stage.
        trace: ``(action, start, end)`` per action when tracing.
        stashed_bytes: peak ``activation_bytes`` and ``weight_bytes`` it kept between forwards and backwards.
        memory_trace: ``(time, activation bytes, weight bytes)`` at every change, when tracing.
        bytes_sent: tensor bytes it sent to other workers.
        sync_stats: what its gradient synchronizer measured.
        ready: ``perf_counter`` when its stages were built and it began training.
        weight_versions: the most versions of its weights it held at once.
        peak_memory: the process's peak resident memory, bytes.
        peak_device_memory: on a GPU, the most bytes of tensors it held there at once
            (``torch.cuda.max_memory_allocated`` of its device); 0 on the CPU.
        saved: the shard files it wrote with ``save`` and the keys in each.
        writing: ``perf_counter`` when it had trained and began writing ``save`` (if given).
    """

    rank: int
    state: dict[str, torch.Tensor]
    digest: str | None
    history: list[dict[str, Any]]
    trace: list[tuple[str, float, float]]
    stashed_bytes: dict[str, int]
    memory_trace: list[tuple[float, int, int]]
    bytes_sent: int
    sync_stats: dict[str, Any]
    ready: float
    weight_versions: int
    peak_memory: int
    peak_device_memory: int = 0
    saved: dict[str, list[str]] = field(default_factory=dict)
    writing: float = 0.0
