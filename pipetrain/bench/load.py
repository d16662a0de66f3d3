"""How much CPU other people's processes take while a benchmark measures, and waiting them out.

[Note: foreign load] Other people's processes share the machine. Time-slicing with them stretches
wall-clock times (a profile and a real run alike, but never by the same amount), so a measurement
records how many cores' worth of CPU processes outside the benchmark used meanwhile: the machine's
busy time (/proc/stat, every core) minus the benchmark's own process tree (this process, every live
descendant from /proc/PID/task/TID/children, and the children each of them has reaped, which
includes pipetrain's workers: they are children of its fork server). Before a measurement the
benchmark waits for the others to go quiet, and it repeats a measurement during which they used
:data:`QUIET_CORES` or more, keeping the quietest (:func:`quietly`). Where /proc is missing the load is
unknown (nan) and nothing is waited for or repeated.
"""
from __future__ import annotations

import math
import os
import resource
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

QUIET_CORES = 0.2
"""Other processes using this many cores' worth of CPU or more during a measurement disturb it."""

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
T = TypeVar("T")


def machine_busy_s() -> float:
    """CPU seconds this machine's cores have been busy since boot (/proc/stat; all processes and the
    kernel's interrupt work alike), or nan where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return math.nan
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TICK  # less idle and iowait


class ProcessCPU(NamedTuple):
    """One live process of the benchmark's tree, as /proc/PID/stat and its threads' stat files say.

    Attributes:
        parent: its parent's pid.
        cpu_s: user + system seconds of its own threads.
        reaped_s: user + system seconds of the children it has waited for (and theirs).
        faults: minor page faults.
        started: start time, in clock ticks after boot.
        threads: CPU seconds by thread kind: ``main`` (the thread whose id is the pid: a worker's
            compute thread), ``gloo`` (gloo's I/O loops, named ``gloo_tcp_loop``...) and ``other``
            (pipetrain's transport threads and anything else).
    """

    parent: int
    cpu_s: float
    reaped_s: float
    faults: int
    started: int
    threads: dict[str, float]


def own_tree() -> dict[int, ProcessCPU]:
    """Every live descendant of this process (children, their children, ...), by pid."""
    out: dict[int, ProcessCPU] = {}
    todo = _children(os.getpid())
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            # after "pid (comm)": ppid is rest[1], minflt rest[7], utime..cstime rest[11:15], starttime rest[19]
            ticks = [int(x) for x in rest[11:15]]
            out[pid] = ProcessCPU(int(rest[1]), (ticks[0] + ticks[1]) / _TICK, (ticks[2] + ticks[3]) / _TICK,
                                  int(rest[7]), int(rest[19]), _threads(pid))
        except (OSError, ValueError, IndexError):  # it ended meanwhile
            continue
        todo += _children(pid)
    return out


def _children(pid: int) -> list[int]:
    pids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def _threads(pid: int) -> dict[str, float]:
    kinds = {"main": 0.0, "gloo": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name, rest = raw[raw.index("(") + 1:raw.rindex(")")], raw.rsplit(")", 1)[1].split()
        kind = "main" if int(tid) == pid else "gloo" if name.startswith("gloo") else "other"
        kinds[kind] += (int(rest[11]) + int(rest[12])) / _TICK
    return kinds


def own_cpu_s(tree: dict[int, ProcessCPU]) -> float:
    """CPU seconds of this process, the children it has reaped (with theirs) and the live ``tree``."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + sum(p.cpu_s + p.reaped_s for p in tree.values())


class Sample(NamedTuple):
    """The machine's and the benchmark's CPU use at ``time`` (``time.perf_counter`` seconds)."""

    time: float
    machine_s: float
    own_s: float
    tree: dict[int, ProcessCPU]


class LoadSampler:
    """``with LoadSampler() as load: ...``, then ``load.foreign()``: other processes' cores meanwhile.

    Samples at the start, at the end and every ``period`` seconds between (in a thread), so that spans
    known only afterwards (a run's measured steps) can be asked about. See [Note: foreign load].

    Args:
        period: seconds between samples, or None for the start and end only (no thread).
    """

    def __init__(self, period: float | None = 0.1) -> None:
        self.period = period
        self.samples: list[Sample] = []
        self.ok = os.path.exists("/proc/stat") and os.path.exists("/proc/self/task")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="load-sampler")

    def _sample(self) -> None:
        tree = own_tree()
        # CPU time only grows; a process that exits after its /proc entry was read and before its parent
        # reaped it counts in neither for one sample, which would show as a dip and as foreign load
        own = max(own_cpu_s(tree), self.samples[-1].own_s if self.samples else 0.0)
        self.samples.append(Sample(time.perf_counter(), machine_busy_s(), own, tree))

    def _loop(self) -> None:
        assert self.period is not None
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> LoadSampler:
        if self.ok:
            self._sample()
            if self.period is not None:
                self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ok:
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join()
            self._sample()

    def _span(self, lo: float, hi: float) -> list[Sample]:
        inside = [s for s in self.samples if lo <= s.time <= hi]
        return inside if len(inside) >= 2 and inside[-1].time > inside[0].time else []

    def foreign(self, lo: float = -math.inf, hi: float = math.inf) -> float:
        """Cores used by other processes between ``perf_counter`` times ``lo`` and ``hi`` (the samples
        inside it), or nan where unknown."""
        inside = self._span(lo, hi)
        if not inside:
            return math.nan
        a, b = inside[0], inside[-1]
        return max(0.0, (b.machine_s - a.machine_s) - (b.own_s - a.own_s)) / (b.time - a.time)

    def processes(self, lo: float, hi: float) -> list[dict[str, float]]:
        """Per leaf process of the tree (one without children: a worker, not the fork server that
        starts workers) alive over the whole span that used CPU in it, oldest first (the launcher
        starts rank 0 first): ``cpu`` seconds, ``faults``, and seconds by thread kind (``main``,
        ``gloo``, ``other``; see :class:`ProcessCPU`)."""
        inside = self._span(lo, hi)
        if not inside:
            return []
        first, last = inside[0].tree, inside[-1].tree
        parents = {p.parent for s in inside for p in s.tree.values()}
        out = []
        for _, pid in sorted((first[p].started, p) for p in first if p in last and p not in parents):
            a, b = first[pid], last[pid]
            d = {"cpu": b.cpu_s - a.cpu_s, "faults": b.faults - a.faults}
            d.update({k: b.threads[k] - a.threads[k] for k in b.threads})
            if d["cpu"] > 0:
                out.append(d)
        return out


def wait_quiet(max_wait_s: float, window_s: float = 2.0) -> float:
    """Wait (up to ``max_wait_s``) until other processes use < QUIET_CORES over ``window_s``; return
    their cores in the last window."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with LoadSampler(None) as load:
            time.sleep(window_s)
        cores = load.foreign()
        if not cores >= QUIET_CORES or time.monotonic() >= deadline:
            return cores


def quietly(fn: Callable[[LoadSampler], T], attempts: int, wait_s: float, what: str, *,
            foreign: Callable[[T, LoadSampler], float] | None = None, period: float | None = 0.1,
            window_s: float = 2.0) -> tuple[T, float]:
    """``fn(sampler)``, repeated while other processes were busy; the quietest result and its cores.

    Args:
        fn: the measurement; it gets the :class:`LoadSampler` running around it.
        attempts: at most this many runs of ``fn``.
        wait_s: before each, wait up to this long for quiet (:func:`wait_quiet`; 0: do not wait).
        what: names the measurement in the line printed when it is disturbed.
        foreign: ``(result, sampler) -> cores`` during what matters (default: all of the run).
        period: the sampler's period (None: start and end only, no sampling thread).
        window_s: :func:`wait_quiet`'s window.
    """
    best: tuple[T, float] | None = None
    for k in range(attempts):
        if wait_s:
            wait_quiet(wait_s, window_s)
        with LoadSampler(period) as load:
            result = fn(load)
        cores = load.foreign() if foreign is None else foreign(result, load)
        if best is None or not cores >= best[1]:
            best = (result, cores)
        if not cores >= QUIET_CORES:
            break
        print(f"  ({what}: other processes used {cores:.2f} cores meanwhile; "
              f"{'retrying' if k + 1 < attempts else 'keeping the quietest attempt'})", flush=True)
    assert best is not None
    return best
