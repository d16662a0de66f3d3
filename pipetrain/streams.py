"""Datasets read in order instead of by index: ``IterableDataset`` streams (token-shard readers,
Hugging Face datasets in streaming mode, WebDataset).

A stream's epoch is one pass over it; its minibatch t is its items [t*B, (t+1)*B), the order a
map-style dataset has with ``shuffle=False``, so every worker that reads a stream can tell an item
by its position. A stream must yield the same items in the same order on every pass and in every
process (a shuffled stream seeds its shuffle and takes :func:`set_epoch`), because a pipeline's
first and last stages, and each data-parallel worker, read it on their own.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from pipetrain.errors import one_line


def is_stream(dataset: Any) -> bool:
    """True for a dataset read by iterating (an ``IterableDataset``, or anything iterable that cannot be
    indexed)."""
    return isinstance(dataset, IterableDataset) or \
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def known_length(stream: Any) -> int | None:
    """The stream's ``len()``, or None where it has none (the usual case)."""
    try:
        return len(stream)
    except TypeError:
        return None


def passes(stream: Any, epoch: int) -> Iterator[Any]:
    """One pass over ``stream`` for ``epoch``: its ``set_epoch(epoch)`` first where it has one (as a
    Hugging Face stream reshuffles by)."""
    set_epoch = getattr(stream, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    return iter(stream)


def count(stream: Any, what: str) -> int:
    """Items in one pass of ``stream`` (one read of it all), or its ``len()`` where it has one."""
    n = known_length(stream)
    if n is not None:
        return n
    try:
        return sum(1 for _ in passes(stream, 0))
    except Exception as e:  # the user's stream may raise anything
        raise ValueError(f"{what} cannot be read ({one_line(e)}); check that iterating it works") from None


def head(dataset: Any, n: int) -> Any:
    """Something indexable holding ``dataset``'s first ``n`` items or more: the dataset itself unless
    it is a stream, else a list of the stream's first ``n`` items (fewer where it ends sooner)."""
    if not is_stream(dataset):
        return dataset
    items = []
    for item in passes(dataset, 0):
        items.append(item)
        if len(items) == n:
            break
    return items
