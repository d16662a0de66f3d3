"""Generic timers: a median wall time and a block run with a given torch thread count.

A leaf: it imports nothing of pipetrain, so any module may time its work with it.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch threads (None: as they are), then set back the count before
    it: what this process times or profiles for the workers is timed as a worker runs it."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1,
                   sync: Callable[[], Any] | None = None) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones; ``sync``
    (e.g. ``torch.cuda.synchronize``) ends each timed call, for work a device runs asynchronously."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
