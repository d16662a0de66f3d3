"""What the simulator takes and gives: a link model and a simulation's result."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipetrain.trace import Record


@dataclass(frozen=True)
class Link:
    """One direction of a point-to-point link: one transfer at a time, FIFO.

    Attributes:
        bandwidth_Bps: bytes per second (``math.inf``: free transfers).
        latency_s: seconds added to every transfer.
    """

    bandwidth_Bps: float = math.inf
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_Bps > 0 or not self.latency_s >= 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self.bandwidth_Bps} B/s, "
                             f"{self.latency_s} s")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds one transfer of ``nbytes`` occupies the link (PipeDream §3.2: bytes / bandwidth)."""
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass
class SimResult:
    """What a simulation predicts.

    Attributes:
        minibatches_per_s: steady-state throughput, measured as the runtime measures it: the
            minibatches of the output stage's optimizer steps after its first, over the time from its
            first step to its last. With a single step (one minibatch of a flush schedule), all
            minibatches over the makespan.
        samples_per_s: ``minibatches_per_s`` times the batch size; None when the batch size is unknown.
        makespan_s: when the last worker finishes.
        busy_fraction: per worker, compute (F and B) seconds / makespan.
        bubble_fraction: 1 - mean busy fraction; for GPipe with equal stages and free communication
            this is the GPipe paper's (p - 1) / (m + p - 1) (arXiv:1811.06965 §2.2).
        peak_weight_versions: per worker, the most distinct weight versions held for minibatches
            in flight (weight stashing, PipeDream §3.4); 1 for schedules that do not stash; for ``2bw``
            the live version counts too, so at most 2 (double buffering).
        peak_activation_bytes: per worker, the most activation bytes stashed for (micro)batches in
            flight (PipeDream §3.5).
        trace: per worker, ``(action_text, start_s, end_s)`` records, the runtime's trace format.
    """

    minibatches_per_s: float
    samples_per_s: float | None
    makespan_s: float
    busy_fraction: list[float]
    bubble_fraction: float
    peak_weight_versions: list[int]
    peak_activation_bytes: list[float]
    trace: list[list[Record]] = field(repr=False)

    def to_dict(self) -> dict[str, object]:
        """Every field but the trace, as plain JSON-ready data."""
        return {"minibatches_per_s": self.minibatches_per_s, "samples_per_s": self.samples_per_s,
                "makespan_s": self.makespan_s,
                "busy_fraction": self.busy_fraction, "bubble_fraction": self.bubble_fraction,
                "peak_weight_versions": self.peak_weight_versions,
                "peak_activation_bytes": self.peak_activation_bytes}
