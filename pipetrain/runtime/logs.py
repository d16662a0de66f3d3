"""What a job writes in ``log_dir``: ``metrics.jsonl`` (what ``pipetrain plot`` reads) and, beside it,
TensorBoard event files (``tensorboard --logdir DIR``).

The output stage's worker writes the updates and evaluations as they happen; the caller adds each
rank's memory once the run is over (:func:`write_memory`), as a TensorBoard run of its own in
``DIR/memory``: a resumed run's writer hides the curves' points from its first step on, which must
not hide the memory of the run before. TensorBoard is optional
(``pip install pipetrain[tensorboard]``): without it the caller warns once (:func:`board_check`)
and the JSON lines are written alone, so a missing package never fails a run.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from pipetrain.errors import warn
from pipetrain.runtime.outcome import RankResult

MEMORY_RUN = "memory"
"""The subdirectory of ``log_dir`` holding each rank's memory peaks."""

FLUSH_S = 10
"""Seconds TensorBoard's writer may hold events before they reach the file (it also flushes after
every evaluation and at the end of the run)."""


def metrics_file(log_dir: str | os.PathLike) -> Path:
    """The metrics log a job writes in ``log_dir``: JSON lines, ``{"kind": "update", ...}`` per update
    (a :class:`~pipetrain.runtime.worker.StepRecord`, its ``time`` in wall-clock seconds since the run
    began), ``{"kind": "eval", "epoch", "step", "loss", METRIC...}`` per evaluation."""
    return Path(log_dir) / "metrics.jsonl"


class JsonLines:
    """A JSON-lines file that records are appended to one by one. The file stays open, and each record
    is flushed to the operating system as it is written, so a killed process loses none; reopening
    the file for every record would cost a fast model's step about 1% of its time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115 - kept open until close()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def start_fresh(log_dir: str | os.PathLike) -> None:
    """Remove the logs of an earlier run in ``log_dir``, so a new run's curves are not drawn over
    them (a resumed run keeps them and goes on)."""
    metrics_file(log_dir).unlink(missing_ok=True)
    for directory in (Path(log_dir), Path(log_dir) / MEMORY_RUN):
        for events in directory.glob("events.out.tfevents.*"):
            events.unlink(missing_ok=True)


def board_check(warn_missing: bool) -> bool:
    """Can TensorBoard files be written here? Where not, warns if ``warn_missing`` (the one process
    of a run that speaks for it)."""
    if _writer_class() is not None:
        return True
    if warn_missing:
        warn("tensorboard is not installed, so log_dir gets metrics.jsonl alone; install pipetrain[tensorboard] "
             "for TensorBoard files")
    return False


def _writer_class() -> Any:
    """torch's ``SummaryWriter``, or None where tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


class MetricsLog:
    """The output stage's side of ``log_dir``: every update and evaluation to ``metrics.jsonl`` and,
    where ``board`` (one writer per job, so replicas of the output stage do not interleave steps in
    one curve), to TensorBoard. Under data parallelism the updates are written at each epoch's end
    (:meth:`updates`), when the loss of each, the mean over the shards, is known.

    Args:
        log_dir: the directory.
        began: ``time.perf_counter()`` when the run began (the ``train`` call): records' times count
            from it. The workers of one machine share that clock.
        board: write TensorBoard events too.
        purge_step: a resumed or restarted run's first step: TensorBoard hides the events earlier
            runs wrote from that step on, so steps trained again are drawn once; None for a new run.
        total_steps: the run's last step (``max_steps``, or every epoch's minibatches), in every
            update's record as ``total_steps``.
        at_epoch_end: the updates wait for :meth:`updates` (data parallelism).
    """

    def __init__(self, log_dir: str | os.PathLike, began: float, board: bool, purge_step: int | None = None,
                 total_steps: int | None = None, at_epoch_end: bool = False) -> None:
        self.path, self.began, self.total, self.at_epoch_end = metrics_file(log_dir), began, total_steps, at_epoch_end
        self._lines = JsonLines(self.path)
        writer = _writer_class() if board else None
        self.writer = writer(str(log_dir), purge_step=purge_step, flush_secs=FLUSH_S) if writer else None

    def update(self, record: dict[str, Any]) -> None:
        """Log one update as it is made (a ``StepRecord`` as a dict, its ``time`` a ``perf_counter``),
        unless updates wait for the epoch's end."""
        if not self.at_epoch_end:
            self._update(record)

    def updates(self, records: list[dict[str, Any]]) -> None:
        """Log an epoch's updates at its end."""
        for record in records:
            self._update(record)

    def _update(self, record: dict[str, Any]) -> None:
        self._lines.append({"kind": "update", **record, "time": record["time"] - self.began,
                            "total_steps": self.total})
        if self.writer is not None:
            step = record["step"]
            self.writer.add_scalar("train/loss", record["loss"], step)
            if record["lr"] is not None:
                self.writer.add_scalar("train/lr", record["lr"], step)
            self.writer.add_scalar("train/samples_per_s", record["samples_per_s"], step)

    def evaluation(self, epoch: int, step: int, scores: dict[str, float], jsonl: bool) -> None:
        """Log the evaluation after ``epoch`` at its last update, ``step``: to TensorBoard where this
        log has the writer, to the JSON lines where ``jsonl`` (this worker made that update)."""
        if jsonl:
            self._lines.append({"kind": "eval", "epoch": epoch, "step": step, **scores})
        if self.writer is not None:
            for name, value in scores.items():
                self.writer.add_scalar(f"eval/{name}", value, step)
            self.writer.flush()

    def close(self) -> None:
        """Write what the TensorBoard writer holds and close the files."""
        self._lines.close()
        if self.writer is not None:
            self.writer.close()


def memory_scalars(reports: Sequence[RankResult]) -> dict[str, int]:
    """Each rank's peaks by TensorBoard tag: its process's resident memory, its GPU's (where it trained on
    one) and what it stashed between forwards and backwards (activations, weight versions)."""
    out: dict[str, int] = {}
    for r in reports:
        out[f"memory/peak_bytes/rank{r.rank}"] = r.peak_memory
        if r.peak_device_memory:
            out[f"memory/peak_device_bytes/rank{r.rank}"] = r.peak_device_memory
        for kind in ("activation_bytes", "weight_bytes"):
            out[f"memory/stashed_{kind}/rank{r.rank}"] = r.stashed_bytes[kind]
    return out


def write_memory(log_dir: str | os.PathLike, reports: Sequence[RankResult], step: int) -> None:
    """Add every rank's memory peaks (:func:`memory_scalars`) to ``log_dir``'s TensorBoard run
    :data:`MEMORY_RUN` at ``step``, the run's last update; nothing where tensorboard is not installed."""
    writer = _writer_class()
    if writer is None:
        return
    with writer(str(Path(log_dir) / MEMORY_RUN)) as board:
        for tag, value in memory_scalars(reports).items():
            board.add_scalar(tag, value, step)
