"""Chunks of layers and the run-time chunk search of CPU-GPU data parallel training (Le et al.,
"Involving CPUs into Multi-GPU Deep Learning", ICPE'18, §4).

Layers are numbered in backward order here: 0 is the model's last layer with parameters, whose
gradient exists first.
"""
from __future__ import annotations

import math


def chunk_layout(num_layers: int, k: int) -> list[list[int]]:
    """The chunks of ``num_layers`` layers at chunk size ``k``, in backward order (§4.2).

    With l layers and l mod k = 0, the first l/k - 1 chunks take k layers each and the last k layers
    are chunks of one; otherwise floor(l/k) chunks of k, then the l - k floor(l/k) layers left over are
    chunks of one ("some last layers have a chunk size of 1 because we would like to reduce the effect
    of t_aa and t_bc on the overhead"). Note that k = l gives l chunks of one, as k = 1 does. A ``k``
    above ``num_layers`` puts every layer in one chunk (ours: the paper does not go past l).

    Raises:
        ValueError: ``k`` < 1.
    """
    if k < 1:
        raise ValueError(f"chunk={k}: a chunk holds at least 1 layer")
    if num_layers == 0:
        return []
    if k > num_layers:
        return [list(range(num_layers))]
    full = num_layers // k - 1 if num_layers % k == 0 else num_layers // k
    chunks = [list(range(i * k, (i + 1) * k)) for i in range(full)]
    return chunks + [[i] for i in range(full * k, num_layers)]


class ChunkSearch:
    """The paper's run-time search for a chunk size (§4.2, Figure 4).

    Call :meth:`record` once per training iteration with that iteration's seconds; it returns the
    chunk size for the next iteration. Every ``interval`` iterations it judges the lapse (the seconds
    of the last ``interval`` iterations): a lapse below the best so far makes the current chunk size
    the best; then, while ``chunk < best + step * range``, it expands the chunk size
    (``chunk + 1`` while below ``step``, else ``chunk + step``); once not, it stops and keeps the best.
    With step 10, range 5 and a best chunk of 9 it judges chunks 1..9, 10, 20, .., 60 and is done after
    iteration 150 with chunk 9, the run the paper reports for Resnet-152.

    Ours: once a chunk size puts every layer in one chunk (``chunk > num_layers``), larger sizes
    change nothing, so the search stops there too.

    Args:
        num_layers: layers with parameters (the chunks' unit).
        step, range: the paper's heuristic parameters.
        interval: iterations per measurement (the paper's 10).

    Attributes:
        chunk: the chunk size to use now (starts at 1).
        best: the best chunk size found so far.
        done: the search has stopped; ``chunk == best`` from then on.
        iterations: iterations recorded so far.
        trials: ``(chunk, lapse)`` of every judged interval.
    """

    def __init__(self, num_layers: int, step: int = 10, range: int = 5, interval: int = 10) -> None:
        if num_layers < 1 or step < 1 or range < 0 or interval < 1:
            raise ValueError(f"ChunkSearch needs num_layers, step, interval >= 1 and range >= 0; got "
                             f"{num_layers}, {step}, {interval}, {range}")
        self.num_layers, self.step, self.range, self.interval = num_layers, step, range, interval
        self.chunk, self.best, self.done = 1, 1, False
        self.iterations = 0
        self.trials: list[tuple[int, float]] = []
        self._lapse_min = math.inf
        self._lapse = 0.0

    def record(self, seconds: float) -> int:
        """One iteration took ``seconds`` at chunk size :attr:`chunk`; return the next one's chunk size."""
        self.iterations += 1
        if self.done:
            return self.chunk
        self._lapse += seconds
        if self.iterations % self.interval:
            return self.chunk
        lapse, self._lapse = self._lapse, 0.0
        self.trials.append((self.chunk, lapse))
        if lapse < self._lapse_min:
            self.best, self._lapse_min = self.chunk, lapse
        if self.chunk >= self.best + self.step * self.range or self.chunk > self.num_layers:
            self.chunk, self.done = self.best, True
        else:
            self.chunk = self.chunk + 1 if self.chunk < self.step else self.chunk + self.step
        return self.chunk


def search_length(num_layers: int, step: int = 10, range: int = 5, interval: int = 10) -> int:
    """The most iterations a :class:`ChunkSearch` can take: every chunk size it tries is the best so
    far, so it runs until the chunk holds every layer (or its stop rule fires)."""
    search = ChunkSearch(num_layers, step, range, interval)
    while not search.done:
        search.record(1.0 / (search.iterations + 1))
    return search.iterations
