"""Runs of the runtime: real ``pipetrain.train`` runs, each stage's worker replayed alone, tracing's cost."""
from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.bench.load import LoadSampler
from pipetrain.config import JobConfig, RunOptions, Training
from pipetrain.layout import Layout
from pipetrain.registry import Pipeline
from pipetrain.runtime.launch import spawn
from pipetrain.runtime.solo import run_stage_alone
from pipetrain.schedule import Action
from pipetrain.trace import durations

from simreal.workload import LR, Config, make_data, train_options, wide_mlp


def real_run(cfg: Config, data: TensorDataset, boundaries: list[int], schedule: str, m: int, trace: bool,
             sampler: LoadSampler) -> dict[str, Any]:
    """One ``pipetrain.train`` run, with the foreign load during its measured steps (``sampler``).

    samples/s is the median of the output stage's per-step rate (``result.history``) over the measured
    steps; per worker, the CPU ms (all threads, and by thread kind) and minor page faults per step.
    """
    t0 = time.perf_counter()
    result = pipetrain.train(wide_mlp(cfg), data, stages=boundaries, trace=trace, **train_options(cfg, schedule, m))
    wall = time.perf_counter() - t0
    rates = [h["samples_per_s"] for h in result.history]
    times = [h["time"] for h in result.history]  # the output stage's perf_counter: this machine's clock
    assert len(rates) == cfg.minibatches, (len(rates), cfg.minibatches)
    lo, hi = times[cfg.skip - 1], times[-cfg.tail - 1]
    steps = len(cfg.measured)
    per_step = [{"cpu_ms": 1e3 * w["cpu"] / steps, "main_ms": 1e3 * w["main"] / steps,
                 "gloo_ms": 1e3 * w["gloo"] / steps, "other_ms": 1e3 * w["other"] / steps,
                 "faults": w["faults"] / steps} for w in sampler.processes(lo, hi)]
    return {"schedule": schedule, "microbatches": m, "samples_per_s": statistics.median(rates[cfg.skip:-cfg.tail]),
            "rates": rates, "traces": result.traces, "wall_s": wall, "foreign_cores": sampler.foreign(lo, hi),
            "workers": per_step}


class StepMarks:
    """An optimizer factory (SGD) that notes (time, process CPU s, minor page faults) after each step."""

    def __init__(self, lr: float) -> None:
        self.lr = lr
        self.marks: list[tuple[float, float, int]] = []

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(params, lr=self.lr)
        opt.register_step_post_hook(lambda *_: self.marks.append(
            (time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)))
        return opt


def _replay_stage(cfg: Config, boundaries: list[int], schedule: str, m: int, stage: int) -> dict[str, Any]:
    """In a fresh worker process: ``stage``'s worker alone (``run_stage_alone``); its trace and step marks."""
    marks = StepMarks(LR)
    o = train_options(cfg, schedule, m, optimizer=marks)
    training = Training(model=wide_mlp(cfg), dataset=make_data(cfg), loss_fn=o["loss_fn"], optimizer=o["optimizer"],
                        batch_size=o["batch_size"], shuffle=o["shuffle"])
    job = JobConfig(training, RunOptions(threads=o["threads"]), Pipeline(), o["schedule"], Layout.pipeline(boundaries))
    return {"trace": run_stage_alone(job, stage, cfg.minibatches, device="cpu"), "marks": marks.marks}


def replay(cfg: Config, boundaries: list[int], schedule: str, m: int) -> list[dict[str, float]]:
    """Each stage's worker replayed alone, one after another, each in a fresh worker process (started
    as the runtime starts its workers: the heap starts fresh, which sets the page faults per step).

    Nothing else runs meanwhile and receives are instant, so each F, B and U costs what the runtime's
    code path costs on one core (data loading, weight stashing, gradient accumulation across
    microbatches, allocation), without a neighbour, transfers or waits.

    Returns:
        Per stage, ms of the median F, B (per (micro)batch) and U over the measured minibatches, and
        the CPU ms and minor page faults per optimizer step.
    """
    out = []
    for stage in range(len(boundaries)):
        got = spawn(_replay_stage, 1, (cfg, boundaries, schedule, m, stage))[0]
        (_, c0, f0), (_, c1, f1) = got["marks"][cfg.skip - 1], got["marks"][cfg.measured.stop - 1]
        steps = len(cfg.measured)
        med = {kind: 1e3 * statistics.median(durations(got["trace"], kind, cfg.measured)) for kind in ("F", "B", "U")}
        out.append({**med, "cpu_ms": 1e3 * (c1 - c0) / steps, "faults": (f1 - f0) / steps})
    return out


def record_cost_us(actions: list[Action], trials: int = 7) -> float:
    """Median µs one trace record adds: the runtime's record code with and without a trace list.

    Mirrors ``Worker.run_epoch``: ``t0`` is taken either way; tracing adds ``str(action)``, a second
    ``perf_counter()``, the tuple and the append.
    """
    clock = time.perf_counter

    def loop(trace: list[tuple[str, float, float]] | None) -> float:
        t = clock()
        for a in actions:
            t0 = clock()
            if trace is not None:
                trace.append((str(a), t0, clock()))
        return clock() - t

    return statistics.median((loop([]) - loop(None)) / len(actions) * 1e6 for _ in range(trials))
