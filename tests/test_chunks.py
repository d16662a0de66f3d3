"""Chunks of layers and the run-time chunk search (CGDP §4), against the paper's text and its run."""
from __future__ import annotations

import pytest

from pipetrain.strategies import ChunkSearch, chunk_layout


def test_chunks_follow_the_papers_rule() -> None:
    # l mod k = 0: l/k - 1 chunks of k, then k chunks of one (6 layers, k = 3)
    assert chunk_layout(6, 3) == [[0, 1, 2], [3], [4], [5]]
    # otherwise floor(l/k) chunks of k, then the l - k floor(l/k) left over one by one (7 layers, k = 3)
    assert chunk_layout(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chunk_layout(7, 2) == [[0, 1], [2, 3], [4, 5], [6]]
    assert chunk_layout(5, 1) == [[0], [1], [2], [3], [4]]
    assert chunk_layout(6, 6) == chunk_layout(6, 1)        # k = l: the rule leaves every layer alone
    assert chunk_layout(6, 7) == [[0, 1, 2, 3, 4, 5]]      # more than the layer count: one chunk
    for layers in range(1, 30):
        for k in range(1, 35):
            flat = [i for c in chunk_layout(layers, k) for i in c]
            assert flat == list(range(layers)), (layers, k)  # every layer once, in backward order
    with pytest.raises(ValueError, match="at least 1 layer"):
        chunk_layout(4, 0)


def run(search: ChunkSearch, time_of) -> int:
    """Feed ``time_of(chunk)`` seconds per iteration until the search is done; return the iterations."""
    while not search.done:
        search.record(time_of(search.chunk))
        assert search.iterations < 10_000
    return search.iterations


def test_reproduces_the_papers_resnet_152_run() -> None:
    """§5.2.6: step 10, range 5; the best chunk, 9, is found at iteration 90, the search runs 6 more
    intervals without finding better and stops after iteration 150, keeping 9."""
    s = ChunkSearch(152, step=10, range=5, interval=10)
    assert s.chunk == 1
    assert run(s, lambda k: 1.0 + abs(k - 9) / 100) == 150
    assert (s.chunk, s.best, s.done) == (9, 9, True)
    assert [k for k, _ in s.trials] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30, 40, 50, 60]
    assert s.trials[0][1] == pytest.approx(10 * 1.08)  # a lapse is the interval's 10 iterations
    assert s.record(123.0) == 9  # done: no more changes


def test_the_chunk_changes_only_every_interval() -> None:
    s = ChunkSearch(50, step=4, range=2, interval=3)
    seen = [s.chunk]
    for _ in range(12):
        seen.append(s.record(1.0))
    # chunk 1 for iterations 1-3, then 2, 3 (below step, +1), then 4 and 8 (+step)
    assert seen == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 8]


def test_a_best_chunk_found_late_extends_the_search() -> None:
    s = ChunkSearch(200, step=10, range=2, interval=1)
    run(s, lambda k: 1.0 / k if k <= 40 else 1.0)  # bigger is better up to 40
    assert s.best == 40
    assert [k for k, _ in s.trials][-3:] == [40, 50, 60]  # range 2: two more tries after the best


def test_stops_once_every_layer_is_in_one_chunk() -> None:
    """Ours: past the layer count every chunk size is the same one chunk."""
    s = ChunkSearch(7, step=10, range=5, interval=10)
    assert run(s, lambda k: 1.0 / k) == 80  # chunks 1..8 judged; 8 is one chunk of all 7 layers
    assert s.best == 8 and chunk_layout(7, s.chunk) == [list(range(7))]


def test_identical_inputs_give_identical_decisions() -> None:
    a, b = ChunkSearch(30), ChunkSearch(30)
    times = [1.0 + ((i * 7919) % 13) / 100 for i in range(400)]
    assert [a.record(t) for t in times] == [b.record(t) for t in times]


def test_bad_parameters() -> None:
    with pytest.raises(ValueError, match="ChunkSearch needs"):
        ChunkSearch(0)
    with pytest.raises(ValueError, match="ChunkSearch needs"):
        ChunkSearch(10, interval=0)
