"""One-line reports of other code's errors, for the one-line errors of ours that wrap them."""
from __future__ import annotations

__all__ = ["first_line", "one_line"]


def first_line(e: BaseException, limit: int | None = 200) -> str:
    """The first line of ``e``'s message, cut at ``limit`` characters; its type's name if it has none."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


def one_line(e: BaseException, limit: int | None = 200) -> str:
    """``e`` as ``Type: first line`` (only ``Type`` when its message is empty)."""
    line = first_line(e, limit)
    name = type(e).__name__
    return name if line == name else f"{name}: {line}"
