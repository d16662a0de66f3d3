"""pipetrain.bench.load: the benchmark's own process tree is not foreign load; disturbed runs repeat."""
from __future__ import annotations

import math
import time

import pytest

from pipetrain.bench.load import QUIET_CORES, LoadSampler, quietly
from pipetrain.runtime.launch import spawn

pytestmark = pytest.mark.skipif(not LoadSampler().ok, reason="needs Linux /proc")


def burn(seconds: float) -> float:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass
    return seconds


@pytest.mark.multiprocess
def test_workers_of_the_fork_server_count_as_own_cpu():
    with LoadSampler(0.05) as load:
        spawn(burn, 2, (0.4,))  # grandchildren: children of the fork server
    first, last = load.samples[0], load.samples[-1]
    assert last.own_s - first.own_s >= 0.75
    assert all(b.own_s >= a.own_s - 0.011 for a, b in zip(load.samples, load.samples[1:]))  # no dip as they end
    assert load.foreign() >= 0.0 and math.isnan(load.foreign(last.time + 1, last.time + 2))


def test_quietly_repeats_while_others_are_busy_and_keeps_the_quietest(capsys):
    runs: list[int] = []

    def measure(_: LoadSampler) -> int:
        runs.append(len(runs) + 1)
        return runs[-1]

    cores = iter([QUIET_CORES + 0.5, QUIET_CORES + 0.1, QUIET_CORES / 2, 0.0])
    assert quietly(measure, 4, 0, "probe", foreign=lambda r, _: next(cores), period=None) == (3, QUIET_CORES / 2)
    assert len(capsys.readouterr().out.splitlines()) == 2  # one line per disturbed run
    cores = iter([0.9, 0.5, 0.7])
    assert quietly(measure, 3, 0, "probe", foreign=lambda r, _: next(cores), period=None) == (5, 0.5)
