"""Simulator vs real runs (issue 4): does ``pipetrain.simulate`` predict what ``pipetrain.train`` measures?

    python benchmarks/sim_vs_real.py            # ~6 min on 2 quiet cores; writes docs/sim_vs_real_*.png
    python benchmarks/sim_vs_real.py --quick    # ~2 min, no PNGs unless --png-dir is given

On one CPU machine, one worker process per core: 2 stages on 2 cores. (3-4 stages would put several
single-threaded workers on one core; the simulator gives every worker a device of its own, so such a
prediction would be wrong by construction, and the script does not try.)

1. Profile: a wide MLP (``DEPTH`` x Linear(``WIDTH``, ``WIDTH``)+ReLU, then a 10-class head), layer by
   layer with ``pipetrain.profile``, in this one process with ``torch.set_num_threads(1)``, the
   thread count of every worker; at the minibatch size and at the microbatch size. CPU layer times
   are not linear in the batch (a 64-row matmul costs ~25% more per row than a 256-row one) while the
   simulator divides a stage's minibatch time by the microbatch count, so microbatched schedules get
   the microbatch profile scaled up by exactly that count (:func:`as_microbatched`). The optimizer
   step (SGD + ``zero_grad``) is timed per stage and passed as ``update_s``. The stage cut is the one
   that balances the profile.
2. Link: a ping-pong through the runtime's own ``Transport`` (gloo on loopback) between two
   otherwise idle processes; one way = round trip / 2; latency = a 4 KB message's one-way time,
   bandwidth from the cut-sized one. Also timed with both cores computing, and the CPU a message costs.
3. Real runs: ``pipetrain.train`` with ``trace=True`` for ``pipedream``, ``gpipe`` and ``1f1b-flush``
   (4 microbatches) and ``model-parallel``; samples/s = median of the output stage's per-step rate
   (``result.history``) without the first ``SKIP`` steps (fill, warm-up) and the last ``TAIL``
   (drain); the median over ``reps`` runs, schedules interleaved.
4. Prediction (A): ``pipetrain.simulate`` of the same action lists with that profile and link; the
   same statistic taken from the simulated trace. Printed beside the measurement with the error.
5. Diagnosis. (B) the same simulation fed each stage's worker replayed alone in a fresh process
   with the runtime's own ``Worker`` and instant receives (:func:`replay_stages`): what the runtime's
   code costs beyond the layers. (C) the simulator fed the real run's own mean action times and
   message delivery time: a check of its rules, not a prediction. Then ms per optimizer step per
   worker and action kind, real vs simulated; CPU time and page faults per step per worker; and the
   CPU-time slowdown of one stage while the other computes in another process.
6. Cost of tracing: ``pipedream`` with ``trace=False`` and ``trace=True`` alternating, median
   samples/s of each; one trace record timed directly in a tight loop of the runtime's record code.

Other people's processes share the machine: see [Note: foreign load]. Run it under the benchmark
lock others use (``flock /tmp/pipetrain-bench.lock python benchmarks/sim_vs_real.py``).
Results and their explanation: BENCHMARKS.md, "Simulator vs real runs (issue 4)".
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset, default_collate

import pipetrain
from pipetrain.profiling import Profile
from pipetrain.registry import build_schedule
from pipetrain.schedule import Action
from pipetrain.simulate import Link, simulate

WIDTH, DEPTH, CLASSES = 1024, 8, 10
BATCH, MICRO = 256, 4               # minibatch size; microbatches for gpipe and 1f1b-flush
SKIP, TAIL = 6, 2                   # steps left out at the start (fill, warm-up) and end (drain)
SCHEDULES = [("pipedream", 1), ("gpipe", MICRO), ("1f1b-flush", MICRO), ("model-parallel", 1)]
ROOT = Path(__file__).resolve().parent.parent


def wide_mlp(width: int = WIDTH, depth: int = DEPTH, classes: int = CLASSES) -> nn.Sequential:
    """``depth`` x (Linear(width, width), ReLU), then Linear(width, classes): 2*depth + 1 layers.

    Each Linear is 1.05M parameters (4.2 MB), so at batch 256 a Linear's forward is ~3.8 ms on one
    core of the reference machine while the activation crossing a cut is only 1 MB: compute dominates.
    """
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def make_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randint(CLASSES, (n,), generator=g))


# -- load on the machine -------------------------------------------------------------------------
# [Note: foreign load] Other people's processes share the 2 cores. Time-slicing with them stretches
# wall-clock times (profile and real run alike, but never by the same amount), so every measurement
# records how many cores' worth of CPU processes outside this benchmark used meanwhile, from
# /proc/stat (whole machine) minus this process and its children (/proc/PID/stat), and is repeated
# when that exceeds QUIET_CORES.
QUIET_CORES = 0.2
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICK


def _children() -> dict[int, tuple[float, int, int, dict[str, float]]]:
    """Live child processes: pid -> (CPU s, minor page faults, start time in ticks, CPU s by thread kind).

    Thread kinds: ``main`` (the compute thread: tid == pid), ``gloo`` (gloo's I/O loop threads, which
    name themselves ``gloo_tcp_loop``) and ``other`` (the Transport's send and receive threads and
    anything else).
    """
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            kinds = {"main": 0.0, "gloo": 0.0, "other": 0.0}
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    raw = f.read()
                name, trest = raw[raw.index("(") + 1:raw.rindex(")")], raw.rsplit(")", 1)[1].split()
                kind = "main" if int(tid) == pid else "gloo" if name.startswith("gloo") else "other"
                kinds[kind] += (int(trest[11]) + int(trest[12])) / _TICK
        except (OSError, ValueError, IndexError):
            continue
        # after "pid (comm)": minflt is rest[7], utime rest[11], stime rest[12], starttime rest[19]
        out[pid] = ((int(rest[11]) + int(rest[12])) / _TICK, int(rest[7]), int(rest[19]), kinds)
    return out


def _own_cpu_s(children: dict[int, tuple[float, int, int, dict[str, float]]]) -> float:
    """CPU seconds of this process, its reaped children and its live ``children``."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + sum(v[0] for v in children.values())


class LoadSampler:
    """Samples the machine's and this job's CPU use every ``period`` s in a thread; see [Note: foreign load].

    Each sample: (perf_counter time, machine busy CPU s, own CPU s, {child pid: (CPU s, faults, start)}).
    """

    def __init__(self, period: float = 0.1) -> None:
        self.period, self.samples = period, []
        self.ok = os.path.exists("/proc/stat") and os.path.exists("/proc/self/task")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        kids = _children()
        self.samples.append((time.perf_counter(), _cpu_busy_s(), _own_cpu_s(kids), kids))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> "LoadSampler":
        if self.ok:
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ok:
            self._stop.set()
            self._thread.join()
            self._sample()

    def _span(self, lo: float, hi: float) -> list[Any]:
        inside = [s for s in self.samples if lo <= s[0] <= hi]
        return inside if len(inside) >= 2 and inside[-1][0] > inside[0][0] else []

    def foreign(self, lo: float = -math.inf, hi: float = math.inf) -> float:
        """Cores used by other processes between perf_counter times ``lo`` and ``hi`` (nan: unknown)."""
        inside = self._span(lo, hi)
        if not self.ok or not inside:
            return math.nan
        (t0, b0, o0, _), (t1, b1, o1, _) = inside[0], inside[-1]
        return max(0.0, (b1 - b0) - (o1 - o0)) / (t1 - t0)

    def workers(self, lo: float, hi: float) -> list[dict[str, float]]:
        """Per child alive over the whole span, oldest first (spawn starts rank 0 first): CPU s in all,
        by thread kind (see :func:`_children`) and minor page faults. Children that used no CPU (the
        multiprocessing resource tracker) are left out."""
        inside = self._span(lo, hi)
        if not inside:
            return []
        first, last = inside[0][3], inside[-1][3]
        out = []
        for _, p in sorted((first[p][2], p) for p in first if p in last):
            d = {"cpu": last[p][0] - first[p][0], "faults": last[p][1] - first[p][1]}
            d.update({k: last[p][3][k] - first[p][3][k] for k in last[p][3]})
            if d["cpu"] > 0:
                out.append(d)
        return out


def load1() -> float:
    return os.getloadavg()[0]


def wait_quiet(max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until other processes use < QUIET_CORES for 2 s; return that load."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with LoadSampler(0.5) as ls:
            time.sleep(2.0)
        cores = ls.foreign()
        if not cores >= QUIET_CORES or time.monotonic() >= deadline:
            return cores


def quietly(fn: Any, attempts: int, wait_s: float, what: str,
            foreign: Any = lambda result, sampler: sampler.foreign()) -> tuple[Any, float]:
    """``fn(sampler)``, repeated while other processes were busy; (the quietest result, its foreign cores).

    ``foreign(result, sampler)`` says how busy the others were during what matters (default: all of it).
    """
    best: tuple[Any, float] | None = None
    for k in range(attempts):
        if wait_s:
            wait_quiet(wait_s)
        with LoadSampler() as ls:
            result = fn(ls)
        cores = foreign(result, ls)
        if best is None or not cores >= best[1]:
            best = (result, cores)
        if not cores >= QUIET_CORES:
            break
        print(f"  ({what}: other processes used {cores:.2f} cores meanwhile; "
              f"{'retrying' if k + 1 < attempts else 'keeping the quietest attempt'})")
    assert best is not None
    return best


# -- 1. profiles -----------------------------------------------------------------------------------
def profile_at(model: nn.Module, data: TensorDataset, batch: int, repeats: int) -> Profile:
    x, y = data.tensors[0][:batch], data.tensors[1][:batch]
    return pipetrain.profile(model, (x, y), F.cross_entropy, repeats=repeats, warmup=3)


def as_microbatched(micro: Profile, m: int, batch: int) -> Profile:
    """A profile the simulator divides by ``m`` back to ``micro``'s measured microbatch times.

    The simulator times a microbatch as (stage's minibatch time) / m; per-layer CPU times are not
    linear in the batch, so instead of scaling the minibatch profile down, scale the microbatch
    profile up by exactly m (times and bytes) and call it a minibatch profile.
    """
    layers = [replace(l, forward_s=l.forward_s * m, backward_s=l.backward_s * m,
                      activation_bytes=l.activation_bytes * m) for l in micro.layers]
    return Profile(layers, batch, micro.device, micro.model, micro.input_bytes * m,
                   {**micro.meta, "measured_at_batch": micro.batch_size, "scaled_by": m})


def balanced_cut(profile: Profile, stages: int = 2) -> list[int]:
    """Boundaries minimising the slowest stage's forward+backward (exhaustive; fine for 2-4 stages)."""
    import itertools

    n = len(profile)
    t = [l.compute_s for l in profile.layers]
    best: tuple[float, list[int]] = (math.inf, [])
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts]
        ends = [*cuts, n]
        worst = max(sum(t[a:b]) for a, b in zip(bounds, ends))
        best = min(best, (worst, bounds))
    return best[1]


def time_update(model: nn.Module, boundaries: list[int], repeats: int) -> list[float]:
    """Median seconds of one SGD step + ``zero_grad(set_to_none=True)`` per stage, as the runtime's ``U``.

    Gradients are set before each step, as a backward would (their allocation is in the profile's
    backward, which also allocates the gradients it returns).
    """
    ends = [*boundaries[1:], len(model)]
    out = []
    for a, b in zip(boundaries, ends):
        params = [p for layer in list(model)[a:b] for p in layer.parameters()]
        opt = torch.optim.SGD(params, lr=1e-6)
        times = []
        for _ in range(repeats + 2):
            for p in params:
                p.grad = torch.zeros_like(p)
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times[2:]))
    return out


def time_runtime_extras(model: nn.Module, boundaries: list[int], data: TensorDataset,
                        repeats: int) -> dict[str, Any]:
    """Work the runtime does that the layer profile does not contain, timed in this process.

    * ``stash_copy_s``: ``pipedream``'s weight stashing copies a stage's weights into a recycled
      buffer when a forward follows an update (``Stashing._copy``): once per minibatch at every stage
      that holds more than one minibatch in flight (all but the output stage, which runs ``Live``).
    * ``accumulate_s``: with microbatches, every backward after a minibatch's first adds its
      weight gradients into ``.grad`` (autograd's AccumulateGrad: ``grad += new``), a pass over the
      stage's gradients that a layer profile, one backward at a time, never makes.
    * ``load_batch_s``: the input stage builds each minibatch from the dataset item by item
      (``Worker._batch``: indexing plus ``default_collate``); the output stage does the same for the
      targets. For microbatched schedules it rebuilds the whole minibatch for every microbatch.
    """
    ends = [*boundaries[1:], len(model)]
    copies, accumulate = [], []
    for a, b in zip(boundaries, ends):
        params = [p for layer in list(model)[a:b] for p in layer.parameters()]
        buffers = [torch.empty_like(p) for p in params]
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            with torch.no_grad():
                for buf, p in zip(buffers, params):
                    buf.copy_(p)
            times.append(time.perf_counter() - t0)
        copies.append(statistics.median(times[2:]))
        grads, new = [torch.zeros_like(p) for p in params], [torch.ones_like(p) for p in params]
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            for g, n in zip(grads, new):
                g += n
            times.append(time.perf_counter() - t0)
        accumulate.append(statistics.median(times[2:]))
    idx = list(range(BATCH))
    loads = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        default_collate([data[i][0] for i in idx])
        loads.append(time.perf_counter() - t0)
    return {"stash_copy_s": copies, "accumulate_s": accumulate, "load_batch_s": statistics.median(loads[2:]),
            "page_fault_us": page_fault_us()}


def page_fault_us(megabytes: int = 64, repeats: int = 5) -> float:
    """Median µs per minor page fault: writing fresh memory minus writing it again, per fault.

    64 MB is above glibc's largest mmap threshold, so every ``torch.empty`` maps new pages.
    """
    n = megabytes * 2**20 // 4
    per = []
    for _ in range(repeats):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        x = torch.empty(n)
        x.fill_(1.0)
        t1 = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        x.fill_(2.0)
        t2 = time.perf_counter()
        per.append(((t1 - t0) - (t2 - t1)) / max(faults, 1) * 1e6)
        del x
    return statistics.median(per)


def _busy_neighbour(model: nn.Module, first: int, last: int, batch: int, stop: Any, ready: Any) -> None:
    """Helper process: run layers ``first..last``'s forward and backward in a loop until ``stop`` is set."""
    torch.set_num_threads(1)
    stage = nn.Sequential(*list(model)[first:last + 1])
    x = torch.randn(batch, WIDTH, requires_grad=first > 0)
    ready.set()
    while not stop.is_set():
        stage(x).float().sum().backward()


def _fb_cpu_s(stage: nn.Module, x: torch.Tensor, repeats: int) -> float:
    """Median CPU seconds (this thread's, so time-slicing with other processes does not count) of F+B."""
    times = []
    for _ in range(repeats + 2):
        c = time.thread_time()
        stage(x).float().sum().backward()
        times.append(time.thread_time() - c)
    return statistics.median(times[2:])


def corun_slowdown(model: nn.Module, stage_layers: list[tuple[int, int]], batch: int, repeats: int) -> float:
    """CPU time of stage 0's F+B with stage 1's F+B running in another process / alone.

    Thread CPU time, not wall time: it does not grow when the scheduler gives the core to someone
    else, only when the work itself runs slower (shared caches, memory bandwidth, a shared physical
    core). The simulator gives each worker a device of its own, so this should be close to 1.
    """
    stage = nn.Sequential(*list(model)[stage_layers[0][0]:stage_layers[0][1] + 1])
    x = torch.randn(batch, WIDTH)
    alone = _fb_cpu_s(stage, x, repeats)
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    helper = ctx.Process(target=_busy_neighbour, args=(model, *stage_layers[1], batch, stop, ready), daemon=True)
    helper.start()
    try:
        ready.wait(60)
        time.sleep(0.3)
        together = _fb_cpu_s(stage, x, repeats)
    finally:
        stop.set()
        helper.join(10)
        if helper.is_alive():
            helper.kill()
    return together / alone


# -- 1b. each stage's worker replayed alone -----------------------------------------------------------
class _InstantTransport:
    """Stands in for the runtime's Transport when one worker's action list runs alone in this process:
    every receive returns at once with fresh tensors of the cut's shape, every send is dropped."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def recv(self, peer: int, mb: int, micro: int | None, what: str) -> Any:
        from pipetrain.runtime.transport import Message

        return Message(mb, micro, 0, [torch.randn(self.shape)], False)

    def send(self, peer: int, msg: Any) -> None:
        pass


class _RecordingSGD(torch.optim.SGD):
    """SGD that notes (time, process CPU s, minor page faults) after every step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marks: list[tuple[float, float, int]] = []

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        self.marks.append((time.perf_counter(), time.process_time(),
                           resource.getrusage(resource.RUSAGE_SELF).ru_minflt))
        return out


def replay_stages(data: TensorDataset, boundaries: list[int], schedule: str, m: int,
                  minibatches: int) -> tuple[Profile, float, list[dict[str, float]]]:
    """Run each worker's real action list with the runtime's own ``Worker``, one worker at a time.

    Nothing else runs meanwhile, and receives are instant, so each F, B and U costs what the runtime's
    code path costs on one core (data loading, weight stashing, gradient accumulation across
    microbatches, allocation), without a neighbour, transfers or waits. Returns a one-layer-per-stage
    profile of the medians (per (micro)batch, scaled by ``m`` as :func:`as_microbatched` does), the
    mean optimizer step, and the per-stage medians in ms.
    """
    import copy

    torch.set_num_threads(1)
    from pipetrain.layers import LayeredModel
    from pipetrain.profiling import LayerProfile
    from pipetrain.runtime.weights import POLICIES
    from pipetrain.runtime.worker import Worker, epoch_order
    from pipetrain.schedule import warmup

    torch.manual_seed(0)
    model = wide_mlp()
    n = len(boundaries)
    ends = [*boundaries[1:], len(model)]
    x = data.tensors[0][:BATCH // m]
    cut_shape = tuple(nn.Sequential(*list(model)[:boundaries[1]])(x).shape) if n > 1 else ()
    sched = build_schedule(schedule, [1] * n, minibatches, m)
    batches = epoch_order(len(data), BATCH, 0, False, 0, 1)[:minibatches]
    layers, medians = [], []
    for rank, (a, b) in enumerate(zip(boundaries, ends)):
        stage = LayeredModel(copy.deepcopy(model)).stage(a, b - 1)
        params = [p for p in stage.parameters() if p.requires_grad]
        # the policy runtime.job picks: stashing for pipedream, except where one minibatch is in flight
        name = "stash" if schedule == "pipedream" and warmup([1] * n, rank) > 1 else "live"
        policy = POLICIES[name](stage)
        opt = _RecordingSGD(params, lr=1e-3)
        worker = Worker(rank, stage, policy, opt, _InstantTransport(cut_shape),
                        data, F.cross_entropy, BATCH, torch.device("cpu"), trace=[])
        worker.run_epoch(sched, 0, batches, 0)
        (_, c0, f0), (_, c1, f1) = opt.marks[SKIP - 1], opt.marks[minibatches - TAIL - 1]
        steps = minibatches - TAIL - SKIP
        med = {}
        for kind in ("F", "B", "U"):
            times = [e - s for text, s, e in worker.trace  # type: ignore[union-attr]
                     if (act := Action.parse(text)).kind == kind and SKIP <= act.mb < minibatches - TAIL]
            med[kind] = statistics.median(times)
        medians.append({**{k: v * 1e3 for k, v in med.items()},
                        "cpu_ms": 1e3 * (c1 - c0) / steps, "faults": (f1 - f0) / steps})
        out_bytes = int(torch.Size(cut_shape).numel() * 4 * m) if rank < n - 1 else 0
        layers.append(LayerProfile(f"stage {rank}", med["F"] * m, med["B"] * m, out_bytes, 0))
    prof = Profile(layers, BATCH, "cpu", "wide_mlp stages, replayed", 0, {"replayed": schedule})
    return prof, statistics.mean(md["U"] for md in medians) / 1e3, medians


def replay_fresh(*args: Any) -> tuple[Profile, float, list[dict[str, float]]]:
    """:func:`replay_stages` in a new process, so its heap starts as fresh as a worker's does (the
    number of page faults per step depends on what the allocator has cached; see BENCHMARKS.md)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), max_tasks_per_child=1) as pool:
        return pool.submit(replay_stages, *args).result()


# -- 2. the link ----------------------------------------------------------------------------------
def _ping_pong(sizes: list[int], rounds: int, busy: bool) -> dict[str, Any]:
    """Run as rank 0 or 1 of a 2-process gloo job: round trips through the runtime's Transport.

    With ``busy``, a thread in each process runs a 64-row Linear forward and backward in a loop
    meanwhile, so both cores compute while messages cross, as in a running pipeline.
    """
    import torch.distributed as dist
    from pipetrain.runtime.transport import Message, Transport

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    tr = Transport(rank, [(0, 1), (1, 0)], "rank {}".format, torch.device("cpu"), 60.0)
    stop = threading.Event()

    def compute() -> None:
        x, w = torch.randn(BATCH // MICRO, WIDTH), torch.randn(WIDTH, WIDTH, requires_grad=True)
        while not stop.is_set():
            (x @ w).sum().backward()

    if busy:
        threading.Thread(target=compute, daemon=True).start()
    tensors = {n: torch.zeros(n // 4) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    cpu = dict.fromkeys(sizes, 0.0)
    mb = 0
    for k in range(rounds + 3):  # sizes interleaved, so a slow spell hits them all; 3 warm-up rounds
        for n in sizes:
            c0, t0 = time.process_time(), time.perf_counter()  # CPU of every thread of this process
            if rank == 0:
                tr.send(1, Message(mb, None, 0, [tensors[n]], False))
                tr.recv(1, mb, None, "pong")
            else:
                msg = tr.recv(0, mb, None, "ping")
                tr.send(0, Message(mb, None, 0, msg.tensors, False))
            if k >= 3:
                times[n].append(time.perf_counter() - t0)
                cpu[n] += time.process_time() - c0
            mb += 1
    # a round sends one message and receives one; with ``busy`` the computing thread's CPU counts too
    out: dict[str, Any] = {str(n): statistics.median(times[n]) / 2 for n in sizes}
    out.update({f"cpu {n}": None if busy else cpu[n] / rounds / 2 for n in sizes})
    stop.set()
    tr.close()
    return out


def measure_link(cut_bytes: int, rounds: int) -> tuple[Link, dict[str, Any]]:
    """Link(latency, bandwidth) from one-way times (round trip / 2) of a 4 KB and a cut-sized message
    between two otherwise idle processes; also the one-way times with both cores computing."""
    from pipetrain.runtime.launch import spawn

    small, micro = 4096, cut_bytes // MICRO
    sizes = [small, micro, cut_bytes]
    idle = spawn(_ping_pong, 2, (sizes, rounds, False))[0]
    busy = spawn(_ping_pong, 2, (sizes, rounds, True))[0]
    t_small, t_cut = idle[str(small)], idle[str(cut_bytes)]
    # a noisy small message may come out slower than the large one; then charge it all to bandwidth
    bandwidth = (cut_bytes - small) / (t_cut - t_small) if t_cut > t_small else cut_bytes / t_cut
    return Link(bandwidth, t_small), {"sizes": sizes, "one_way_idle_s": [idle[str(n)] for n in sizes],
                                      "one_way_busy_s": [busy[str(n)] for n in sizes],
                                      "cpu_per_message_end_s": [idle[f"cpu {n}"] for n in sizes]}


# -- 3. real runs ------------------------------------------------------------------------------------
def real_run(data: TensorDataset, boundaries: list[int], schedule: str, m: int, minibatches: int,
             trace: bool, sampler: LoadSampler) -> dict[str, Any]:
    """One ``pipetrain.train`` run, with the foreign load during its measured steps (``sampler``)."""
    torch.manual_seed(0)
    model = wide_mlp()
    t0 = time.perf_counter()
    result = pipetrain.train(model, data, loss_fn=F.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
                             stages=boundaries, schedule=schedule, batch_size=BATCH, microbatches=m,
                             epochs=1, shuffle=False, threads=1, trace=trace)
    wall = time.perf_counter() - t0
    rates = [h["samples_per_s"] for h in result.history]
    times = [h["time"] for h in result.history]  # the output stage's perf_counter: this machine's clock
    assert len(rates) == minibatches, (len(rates), minibatches)
    lo, hi = times[SKIP - 1], times[-TAIL - 1]
    steps = minibatches - TAIL - SKIP
    # per worker, per optimizer step in the measured steps: CPU ms (all its threads) and page faults
    per_step = [{"cpu_ms": 1e3 * w["cpu"] / steps, "main_ms": 1e3 * w["main"] / steps,
                 "gloo_ms": 1e3 * w["gloo"] / steps, "other_ms": 1e3 * w["other"] / steps,
                 "faults": w["faults"] / steps} for w in sampler.workers(lo, hi)]
    return {"schedule": schedule, "microbatches": m, "samples_per_s": statistics.median(rates[SKIP:-TAIL]),
            "rates": rates, "traces": result.traces, "wall_s": wall, "foreign_cores": sampler.foreign(lo, hi),
            "load1": load1(), "workers": per_step}


def step_rates(trace: list[list[tuple[str, float, float]]], batch: int) -> list[float]:
    """Per optimizer step of the output stage: batch / time since the previous step (or the start)."""
    ends = [e for a, _, e in trace[-1] if a.startswith("U")]
    start = min(s for t in trace for _, s, _ in t[:1])
    return [batch / (b - a) for a, b in zip([start, *ends], ends)]


# -- 5. where the time goes --------------------------------------------------------------------------
def delivery_s(trace: list[list[tuple[str, float, float]]]) -> float:
    """Mean seconds from a send being queued to its receive returning, in a real run.

    Only messages whose receiver was already waiting count, so the time is the transport's, not the
    receiver's lateness. Local workers share one clock (CLOCK_MONOTONIC), so the two ends compare.
    """
    sends, recvs = {}, {}
    for records in trace:
        for text, s, e in records:
            a = Action.parse(text)
            if a.kind in ("SF", "SB"):
                sends[(a.kind[1], a.mb, a.micro)] = s
            elif a.kind in ("RF", "RB"):
                recvs[(a.kind[1], a.mb, a.micro)] = (s, e)
    times = [recvs[k][1] - s for k, s in sends.items() if k in recvs and recvs[k][0] < s]
    return statistics.mean(times) if times else math.nan


def simulate_with_real_times(trace: list[list[tuple[str, float, float]]], schedule: str, m: int,
                             minibatches: int, link: Link, cut_bytes: int) -> tuple[float, Link]:
    """The simulator fed the real run's own action times: a consistency check of its timing rules.

    Each stage gets the mean F, B (per microbatch) and U of its worker in the real run's measured
    steps (means: a pipeline's rate follows the sum of its times, not their median), and every
    transfer the mean delivery time measured in that run (:func:`delivery_s`; the link keeps the
    measured bandwidth, latency absorbs the rest). What remains of the error is then the simulator's
    own: its dependency and timing rules, and constants standing for varying times.
    """
    from pipetrain.profiling import LayerProfile

    layers, ups = [], []
    for rank, records in enumerate(trace):
        med = {}
        for kind in ("F", "B", "U"):
            med[kind] = statistics.mean(e - s for text, s, e in records
                                        if (a := Action.parse(text)).kind == kind
                                        and SKIP <= a.mb < minibatches - TAIL)
        ups.append(med["U"])
        layers.append(LayerProfile(f"stage {rank}", med["F"] * m, med["B"] * m,
                                   cut_bytes if rank < len(trace) - 1 else 0, 0))
    per_message = cut_bytes / m
    delivered = delivery_s(trace)
    latency = max(0.0, delivered - per_message / link.bandwidth_Bps) if delivered == delivered else link.latency_s
    real_link = Link(link.bandwidth_Bps, latency)
    sim = simulate(build_schedule(schedule, [1] * len(trace), minibatches, m),
                   Profile(layers, BATCH, "cpu", "real action times"), list(range(len(trace))), real_link,
                   batch_size=BATCH, update_s=statistics.mean(ups))
    return statistics.median(step_rates(sim.trace, BATCH)[SKIP:-TAIL]), real_link


KINDS = ("F", "B", "U", "RF", "RB", "SF", "SB")


def budget(trace: list[list[tuple[str, float, float]]], steps: int) -> list[dict[str, float]]:
    """Per worker: ms per optimizer step spent in each action kind, in the steady-state window.

    The window runs from the output stage's step ``SKIP`` to its step ``steps - TAIL`` (the steps
    the samples/s median uses); "other" is the window's time in no recorded action. Receives include
    their wait for the message.
    """
    ends = [e for a, _, e in trace[-1] if a.startswith("U")]
    lo, hi = ends[SKIP - 1], ends[steps - TAIL - 1]
    n = steps - TAIL - SKIP
    out = []
    for records in trace:
        b = dict.fromkeys(KINDS, 0.0)
        for text, s, e in records:
            if e > lo and s < hi:  # the part of the record inside the window
                b[Action.parse(text).kind] += min(e, hi) - max(s, lo)
        b = {k: v / n * 1e3 for k, v in b.items()}
        b["other"] = (hi - lo) / n * 1e3 - sum(b.values())
        out.append(b)
    return out


# -- 6. tracing cost ---------------------------------------------------------------------------------
def record_cost_us(actions: list[Action], trials: int = 7) -> float:
    """Median µs one trace record adds: the runtime's record code with and without a trace list.

    Mirrors ``Worker.run_epoch``: ``t0`` is taken either way; tracing adds ``str(action)``, a second
    ``perf_counter()``, the tuple and the append.
    """
    clock = time.perf_counter
    per = []
    for _ in range(trials):
        trace: list[tuple[str, float, float]] | None = []
        t = clock()
        for a in actions:
            t0 = clock()
            if trace is not None:
                trace.append((str(a), t0, clock()))
        traced = clock() - t
        trace = None
        t = clock()
        for a in actions:
            t0 = clock()
            if trace is not None:
                trace.append((str(a), t0, clock()))
        plain = clock() - t
        per.append((traced - plain) / len(actions) * 1e6)
    return statistics.median(per)


# -- the whole benchmark -------------------------------------------------------------------------------
class Patience:
    """A budget of seconds for waiting on other processes and for repeating disturbed measurements."""

    def __init__(self, wait_s: float, attempts: int, budget_s: float) -> None:
        self.wait_s, self.attempts, self.deadline = wait_s, attempts, time.monotonic() + budget_s

    def __call__(self, fn: Any, what: str, foreign: Any = lambda result, sampler: sampler.foreign()) -> tuple[Any, float]:
        left = self.deadline - time.monotonic()
        return quietly(fn, self.attempts if left > 0 else 1, min(self.wait_s, max(left, 0.0)), what, foreign)


def _name(schedule: str, m: int) -> str:
    return schedule + (f" ({m} microbatches)" if m > 1 else "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="24 minibatches per run, 1 run per schedule, 2 tracing pairs, no waiting (< 3 min)")
    ap.add_argument("--png-dir", type=Path, default=None,
                    help="where to write sim_vs_real_{measured,simulated}.png (default: docs/ for a full "
                         "run, none for --quick)")
    ap.add_argument("--json", type=Path, default=None, help="also write every number to this JSON file")
    ap.add_argument("--patience", type=float, default=None,
                    help="seconds in all to spend waiting for other processes to go quiet and repeating "
                         "disturbed measurements (default 900; 0 with --quick); see [Note: foreign load]")
    args = ap.parse_args(argv)
    quick = args.quick
    minibatches = 24 if quick else 48
    reps = 1 if quick else 3
    trace_pairs = 2 if quick else 5
    png_dir = args.png_dir if args.png_dir is not None else (None if quick else ROOT / "docs")
    budget_s = args.patience if args.patience is not None else (0.0 if quick else 900.0)
    patience = Patience(wait_s=60.0, attempts=4, budget_s=budget_s)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    print(f"# {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, python "
          f"{platform.python_version()}; load average {load1():.2f}")
    data = make_data(BATCH * minibatches)
    model = wide_mlp()

    # 1. profiles, in this one process with 1 thread, like every worker
    def take_profiles(_: LoadSampler) -> dict[str, Any]:
        prof = profile_at(model, data, BATCH, repeats=10)
        bounds = balanced_cut(prof)
        return {"prof": prof, "prof_micro": profile_at(model, data, BATCH // MICRO, repeats=10),
                "boundaries": bounds, "update": time_update(model, bounds, repeats=10),
                "extras": time_runtime_extras(model, bounds, data, repeats=10)}

    p, prof_foreign = patience(take_profiles, "profiles")
    prof, prof_micro, boundaries, update, extras = (p[k] for k in ("prof", "prof_micro", "boundaries",
                                                                    "update", "extras"))
    update_s = statistics.mean(update)
    ends = [*boundaries[1:], len(prof)]
    stage_layers = [(a, b - 1) for a, b in zip(boundaries, ends)]
    profiles = {1: prof, MICRO: as_microbatched(prof_micro, MICRO, BATCH)}
    corun = {b: corun_slowdown(model, stage_layers, b, repeats=10) for b in (BATCH, BATCH // MICRO)}

    def stage_sums(p: Profile) -> list[tuple[float, float]]:
        return [(sum(l.forward_s for l in p.layers[a:b + 1]), sum(l.backward_s for l in p.layers[a:b + 1]))
                for a, b in stage_layers]

    print(f"stages {boundaries} (layers {stage_layers} of {len(prof)}), the cut that balances the profile; "
          f"other processes used {prof_foreign:.2f} cores while profiling")
    print("\n| layer profile, 1 thread, ms per (micro)batch | stage 0 F / B | stage 1 F / B |\n|---|---|---|")
    for b, pr in ((BATCH, prof), (BATCH // MICRO, prof_micro)):
        print(f"| batch {b} | " + " | ".join(f"{f * 1e3:.2f} / {bw * 1e3:.2f}" for f, bw in stage_sums(pr)) + " |")
    print(f"\noptimizer step (U) per stage {', '.join(f'{u * 1e3:.2f}' for u in update)} ms -> update_s "
          f"{update_s * 1e3:.2f} ms. Not in the layer profile: pipedream's weight stash copy per minibatch "
          f"({', '.join(f'{c * 1e3:.2f}' for c in extras['stash_copy_s'])} ms per stage); adding one "
          f"microbatch's gradients into .grad ({', '.join(f'{c * 1e3:.2f}' for c in extras['accumulate_s'])} "
          f"ms per stage); building a "
          f"minibatch from the dataset ({extras['load_batch_s'] * 1e3:.2f} ms). One minor page fault "
          f"costs {extras['page_fault_us']:.2f} µs.")
    print("CPU time of stage 0's F+B while stage 1's F+B runs in another process, over alone: " +
          ", ".join(f"{v:.3f} at batch {b}" for b, v in corun.items()))

    # 2. the link
    cut_bytes = prof.layers[boundaries[1] - 1].activation_bytes
    (link, link_raw), link_foreign = patience(lambda _: measure_link(cut_bytes, rounds=30), "link")
    print("link (gloo on loopback, through the runtime's Transport), one way: " + ", ".join(
        f"{n / 1e3:.0f} KB {i * 1e6:.0f} µs ({bz * 1e6:.0f} µs with both cores computing)"
        for n, i, bz in zip(link_raw["sizes"], link_raw["one_way_idle_s"], link_raw["one_way_busy_s"]))
        + f" -> Link(latency {link.latency_s * 1e6:.0f} µs, bandwidth {link.bandwidth_Bps / 1e9:.2f} GB/s) "
          f"from the idle ones; other processes used {link_foreign:.2f} cores. CPU per message, per end "
          f"(all threads of a process): " + ", ".join(f"{n / 1e3:.0f} KB {c * 1e6:.0f} µs" for n, c in
                                                      zip(link_raw["sizes"], link_raw["cpu_per_message_end_s"])))

    # 3. per repetition and schedule: each stage's worker replayed alone (see replay_stages), then the
    # real run; close in time, so drifts in the machine's speed hit both, and interleaved over schedules
    print()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s, _ in SCHEDULES}
    replay_runs: dict[str, list[Any]] = {s: [] for s, _ in SCHEDULES}
    for rep in range(reps):
        for schedule, m in SCHEDULES:
            rp, _ = patience(lambda _: replay_fresh(data, boundaries, schedule, m, minibatches),
                             f"replay {schedule}")
            replay_runs[schedule].append(rp)
            r, _ = patience(lambda ls: real_run(data, boundaries, schedule, m, minibatches, True, ls),
                            schedule, foreign=lambda r, _: r["foreign_cores"])
            runs[schedule].append(r)
            print(f"  run {rep + 1}/{reps} {schedule:14s} {r['samples_per_s']:6.0f} samples/s (other processes "
                  f"{r['foreign_cores']:.2f} cores during the measured steps, load average {r['load1']:.2f})")
    # a replay per schedule: the one whose repetition gave the median real run
    replays = {}
    for schedule, _ in SCHEDULES:
        measured = statistics.median(r["samples_per_s"] for r in runs[schedule])
        k = min(range(reps), key=lambda i: abs(runs[schedule][i]["samples_per_s"] - measured))
        replays[schedule] = replay_runs[schedule][k]
    print("\nEach stage's worker replayed alone (the runtime's Worker, receives instant), ms per (micro)batch, "
          "vs the layer profile:\n")
    print("| schedule | stage 0 F / B / U | stage 1 F / B / U | layer profile: stage 0 F / B; stage 1 F / B |")
    print("|---|---|---|---|")
    for schedule, m in SCHEDULES:
        cells = " | ".join(f"{md['F']:.2f} / {md['B']:.2f} / {md['U']:.2f}" for md in replays[schedule][2])
        ref = "; ".join(f"{f * 1e3 / m:.2f} / {b * 1e3 / m:.2f}" for f, b in stage_sums(profiles[m]))
        print(f"| {_name(schedule, m)} | {cells} | {ref} |")

    # 4. simulate the same action lists
    rows = []
    for schedule, m in SCHEDULES:
        sched = build_schedule(schedule, [1] * len(boundaries), minibatches, m)
        sim = simulate(sched, profiles[m], boundaries, link, batch_size=BATCH, update_s=update_s)
        pred = statistics.median(step_rates(sim.trace, BATCH)[SKIP:-TAIL])
        sims_r = [simulate(sched, rprof, list(range(len(boundaries))), link, batch_size=BATCH, update_s=rupdate)
                  for rprof, rupdate, _ in replay_runs[schedule]]
        preds_r = [statistics.median(step_rates(x.trace, BATCH)[SKIP:-TAIL]) for x in sims_r]
        pred_r = statistics.median(preds_r)
        measured = statistics.median(r["samples_per_s"] for r in runs[schedule])
        k = min(range(reps), key=lambda i: abs(runs[schedule][i]["samples_per_s"] - measured))
        rep_run, sim_r = runs[schedule][k], sims_r[k]
        pred_t, link_t = simulate_with_real_times(rep_run["traces"], schedule, m, minibatches, link, cut_bytes)
        rows.append({"schedule": schedule, "microbatches": m, "predicted": pred,
                     "predicted_sim_samples_per_s": sim.samples_per_s, "measured": measured,
                     "measured_runs": [r["samples_per_s"] for r in runs[schedule]],
                     "error_pct": 100 * (pred - measured) / measured, "predicted_replay": pred_r,
                     "error_replay_pct": 100 * (pred_r - measured) / measured, "predicted_replay_runs": preds_r,
                     "predicted_real_times": pred_t, "run_measured": rep_run["samples_per_s"],
                     "error_real_times_pct": 100 * (pred_t - rep_run["samples_per_s"]) / rep_run["samples_per_s"],
                     "delivery_ms": 1e3 * delivery_s(rep_run["traces"]),
                     "link_model_ms": 1e3 * link.transfer_s(cut_bytes / m),
                     "foreign_cores": [r["foreign_cores"] for r in runs[schedule]],
                     "workers_real": rep_run["workers"],
                     "budget_real": budget(rep_run["traces"], minibatches),
                     "budget_sim": budget(sim.trace, minibatches),
                     "budget_replay": budget(sim_r.trace, minibatches),
                     "_sim_trace": sim.trace, "_real_trace": rep_run["traces"]})

    print(f"\n## {len(boundaries)} stages on {os.cpu_count()} cores, batch {BATCH}, {minibatches} minibatches "
          f"per run, median of steps {SKIP + 1}..{minibatches - TAIL}, median of {reps} run(s)\n")
    print("Predicted from (A) the layer profile (pipetrain.profile, one process, 1 thread) and (B) each stage's "
          "worker replayed alone with the runtime's own code; both with the idle ping-pong link:\n")
    print("| schedule | predicted (A) | predicted (B) | measured samples/s | error (A) % | error (B) % | other "
          "processes during the measured steps, cores |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {_name(r['schedule'], r['microbatches'])} | {r['predicted']:.0f} | {r['predicted_replay']:.0f} | "
              f"{r['measured']:.0f} | {r['error_pct']:+.1f} | {r['error_replay_pct']:+.1f} | "
              f"{', '.join(f'{c:.2f}' for c in r['foreign_cores'])} |")
    print("\nThe simulator's rules checked: (C) fed the real run's own mean F, B, U per worker and its mean "
          "message delivery time (send queued -> receive returned, receiver already waiting):\n")
    print("| schedule | one message, ms: link model / ping-pong with both cores busy / delivered in the run | "
          "that run, samples/s | (C) | error (C) % |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        busy_ms = 1e3 * link_raw["one_way_busy_s"][1 if r["microbatches"] > 1 else 2]
        print(f"| {_name(r['schedule'], r['microbatches'])} | {r['link_model_ms']:.2f} / {busy_ms:.2f} / "
              f"{r['delivery_ms']:.2f} | {r['run_measured']:.0f} | {r['predicted_real_times']:.0f} | "
              f"{r['error_real_times_pct']:+.1f} |")

    print("\nWhere the time goes, ms per optimizer step in the measured steps: real / simulated from the layer "
          "profile / simulated from the replayed stages (a receive includes its wait; other: in no action):\n")
    print("| schedule | worker | " + " | ".join(KINDS) + " | other |")
    print("|---|---|" + "---:|" * (len(KINDS) + 1))
    for r in rows:
        for w, (br, bs, bp) in enumerate(zip(r["budget_real"], r["budget_sim"], r["budget_replay"])):
            cells = " | ".join(f"{br[k]:.1f} / {bs[k]:.1f} / {bp[k]:.1f}" for k in (*KINDS, "other"))
            print(f"| {r['schedule']} | {w} | {cells} |")
    print("\nCPU ms per optimizer step per worker, real run (all threads = compute thread + gloo I/O threads + "
          "other threads) vs replayed alone, and minor page faults per step, real / replayed:\n")
    print("| schedule | worker | real CPU ms | = compute + gloo + other | replayed CPU ms | faults |")
    print("|---|---|---:|---|---:|---:|")
    nan = {"cpu_ms": math.nan, "main_ms": math.nan, "gloo_ms": math.nan, "other_ms": math.nan, "faults": math.nan}
    for r in rows:
        for w, md in enumerate(replays[r["schedule"]][2]):
            real = r["workers_real"][w] if w < len(r["workers_real"]) else nan
            print(f"| {r['schedule']} | {w} | {real['cpu_ms']:.1f} | {real['main_ms']:.1f} + {real['gloo_ms']:.1f} + "
                  f"{real['other_ms']:.1f} | {md['cpu_ms']:.1f} | {real['faults']:.0f} / {md['faults']:.0f} |")

    # PNGs of the pipedream run, real (local workers share CLOCK_MONOTONIC: one offset) and simulated
    pngs = []
    if png_dir is not None:
        from pipetrain.trace import draw_timeline

        png_dir.mkdir(parents=True, exist_ok=True)
        pd = rows[0]
        real = pd["_real_trace"]
        start = min(t[0][1] for t in real if t)
        names = [f"worker {w} (stage {w})" for w in range(len(real))]
        title = f"pipedream, MLP {DEPTH}x{WIDTH}, batch {BATCH}, stages {boundaries}, 2 cores"
        draw_timeline(real, png_dir / "sim_vs_real_measured.png", names=names, offsets=[start] * len(real),
                      title=f"{title}: measured, {pd['measured']:.0f} samples/s")
        draw_timeline(pd["_sim_trace"], png_dir / "sim_vs_real_simulated.png", names=names,
                      title=f"{title}: simulated from the layer profile, {pd['predicted']:.0f} samples/s")
        pngs = [str(png_dir / "sim_vs_real_measured.png"), str(png_dir / "sim_vs_real_simulated.png")]
        print(f"\nwrote {pngs[0]} and {pngs[1]}")

    # 5. the cost of tracing: off and on alternating, so drifts in the machine's load hit both alike
    trace_runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(trace_pairs):
        for flag in (False, True):
            r, _ = patience(lambda ls: real_run(data, boundaries, "pipedream", 1, minibatches, flag, ls),
                            f"pipedream, trace={flag}", foreign=lambda r, _: r["foreign_cores"])
            trace_runs[flag].append(r)
    off = [r["samples_per_s"] for r in trace_runs[False]]
    on = [r["samples_per_s"] for r in trace_runs[True]]
    cpu = {flag: statistics.median(sum(w["cpu_ms"] for w in r["workers"]) for r in rs)
           for flag, rs in trace_runs.items()}
    sched = build_schedule("pipedream", [1] * len(boundaries), minibatches)
    per_record = record_cost_us([a for acts in sched.actions for a in acts] * 200)
    records_per_step = sum(len(a) for a in sched.actions) / minibatches / len(sched.actions)
    step_ms = 1e3 * BATCH / statistics.median(off)
    tracing = {"off": off, "on": on, "median_off": statistics.median(off), "median_on": statistics.median(on),
               "overhead_pct": 100 * (statistics.median(off) - statistics.median(on)) / statistics.median(off),
               "foreign_off": [r["foreign_cores"] for r in trace_runs[False]],
               "foreign_on": [r["foreign_cores"] for r in trace_runs[True]],
               "cpu_ms_per_step_off": cpu[False], "cpu_ms_per_step_on": cpu[True],
               "per_record_us": per_record, "records_per_step_per_worker": records_per_step,
               "expected_overhead_pct": 100 * per_record * 1e-3 * records_per_step / step_ms}
    print(f"\ntracing, pipedream, {trace_pairs} alternating pairs, median samples/s: off "
          f"{tracing['median_off']:.0f} {[round(x) for x in off]}, on {tracing['median_on']:.0f} "
          f"{[round(x) for x in on]} -> overhead {tracing['overhead_pct']:+.2f}%; both workers' CPU per step "
          f"{cpu[False]:.1f} ms off, {cpu[True]:.1f} ms on; other processes, cores: off "
          f"{', '.join(f'{c:.2f}' for c in tracing['foreign_off'])}, on "
          f"{', '.join(f'{c:.2f}' for c in tracing['foreign_on'])}")
    print(f"one trace record costs {per_record:.2f} µs (tight loop of the runtime's record code); "
          f"{records_per_step:.0f} records per worker per {step_ms:.0f} ms step -> "
          f"{tracing['expected_overhead_pct']:.4f}% expected")
    elapsed = time.perf_counter() - t_start
    print(f"\n# load average at the end {load1():.2f}; took {elapsed:.0f} s")

    out = {"machine": {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
           "config": {"width": WIDTH, "depth": DEPTH, "batch": BATCH, "microbatches": MICRO,
                      "minibatches": minibatches, "skip": SKIP, "tail": TAIL, "reps": reps,
                      "boundaries": boundaries, "quick": quick},
           "profile_foreign_cores": prof_foreign, "update_s": update, "extras": extras,
           "corun_cpu_slowdown": corun, "elapsed_s": elapsed,
           "link": {"bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s, **link_raw,
                    "foreign_cores": link_foreign},
           "stage_profile_ms": {k: [[1e3 * v for v in fb] for fb in stage_sums(p)] for k, p in
                                [("batch", prof), (f"micro_x{MICRO}", profiles[MICRO])]},
           "replay_ms": {k: v[2] for k, v in replays.items()},
           "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
           "tracing": tracing, "pngs": pngs}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
