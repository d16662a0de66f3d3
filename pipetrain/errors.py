"""pipetrain's error and warning types, and one-line reports of other code's errors for ours that wrap them."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

__all__ = ["PipetrainError", "PipetrainWarning", "first_line", "named", "one_line", "warn"]


def first_line(e: BaseException, limit: int | None = 200) -> str:
    """The first line of ``e``'s message, cut at ``limit`` characters; its type's name if it has none."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


def one_line(e: BaseException, limit: int | None = 200) -> str:
    """``e`` as ``Type: first line`` (only ``Type`` when its message is empty)."""
    line = first_line(e, limit)
    name = type(e).__name__
    return name if line == name else f"{name}: {line}"


def named(value: Any, limit: int = 80) -> str:
    """``value``'s repr for a one-line error, or ``<a Type>`` where that repr spans lines or runs long
    (an optimizer's, a module's)."""
    text = repr(value)
    return text if "\n" not in text and len(text) <= limit else f"<a {type(value).__name__}>"


class PipetrainError(RuntimeError):
    """A job failed; the message says which worker and why.

    Attributes:
        kind: ``"error"`` (a worker raised: its own error, such as a bad loss), ``"died"`` (a worker
            ended without one: killed, crashed), ``"silent"`` (a worker stopped showing signs of life),
            ``"timeout"`` (the job ran past ``spawn``'s ``timeout``) or ``"unstarted"`` (a worker process
            never began its task; ``spawn`` starts the job again).
        rank: the worker the message is about, or None.
        log: the file holding every failed worker's traceback (or, for a silent or timed-out job, every
            running worker's Python stacks), or None.
        history: what the run had recorded (``TrainResult.history`` records) when it failed.
        checkpoint_epoch: the newest epoch every worker saved, or None.
    """

    def __init__(self, message: str, kind: str = "error", rank: int | None = None, log: Path | None = None) -> None:
        super().__init__(message)
        self.kind, self.rank, self.log = kind, rank, log
        self.history: list[dict[str, Any]] = []
        self.checkpoint_epoch: int | None = None


class PipetrainWarning(UserWarning):
    """Something the user should know that does not stop the job (a damaged checkpoint skipped, ...)."""


def warn(message: str) -> None:
    """Warn with a :class:`PipetrainWarning` (the CLI prints these as one line)."""
    warnings.warn(message, PipetrainWarning, stacklevel=2)
