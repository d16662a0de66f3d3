"""Predictions: everything that turns measurements into ``pipetrain.simulate``'s inputs, and runs it.

Three predictions of the same action lists, changing one input at a time:

* (A) :func:`from_layer_profile`: what ``stages="auto"`` predicts with: the layer profile
  (``pipetrain.profile`` in this one process, one thread, like every worker) with each layer's SGD
  step, and the run set-up measured with two workers (:func:`measured_setup`: how the two slow each
  other on shared cores, what a message costs while they compute, copies), each training on a
  minibatch or, for the microbatched schedules, a microbatch: two workers of width-1024 Linear layers
  slowed each other 1.27x at 64 rows and 0.97x at 256 (the co-run figure the report prints).
* (B) :func:`from_replay`: each stage's worker replayed alone (:func:`simreal.runs.replay`): what the
  runtime's code costs beyond the layers, with the same link.
* (C) :func:`from_real_times`: a real run's own mean action times and message delivery time: a check
  of the simulator's rules, not a prediction.

Each gives the benchmark's statistic (:func:`rate`) and the simulated trace. This module is the one
to change when the profile and the simulator learn more.
"""
from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.profiling import LayerProfile, Profile, time_batching
from pipetrain.registry import build_schedule, schedule_of
from pipetrain.setup import Setup, measure_setup, model_step
from pipetrain.simulate import Link, simulate
from pipetrain.trace import Record, deliveries, durations, step_rates

from simreal.workload import LR, Config


@dataclass
class Prediction:
    """A simulation of one schedule: the benchmark's statistic, ``SimResult.samples_per_s``, the trace."""

    samples_per_s: float
    sim_samples_per_s: float
    trace: list[list[Record]]


def rate(cfg: Config, traces: list[list[Record]]) -> float:
    """The benchmark's statistic: the median samples/s of the output stage's measured steps."""
    return statistics.median(step_rates(traces, cfg.batch)[cfg.skip:-cfg.tail])


def predict(cfg: Config, schedule: str, m: int, profile: Profile, boundaries: list[int], link: Link,
            update_s: float | None) -> Prediction:
    """Simulate ``schedule`` (``cfg.minibatches`` minibatches, ``m`` microbatches) on one worker per stage
    (``update_s`` None: each stage's optimizer steps from the profile)."""
    sched = build_schedule(schedule_of(schedule, m), [1] * len(boundaries), cfg.minibatches)
    sim = simulate(sched, profile, boundaries, link, batch_size=cfg.batch, update_s=update_s)
    return Prediction(rate(cfg, sim.trace), sim.samples_per_s or math.nan, sim.trace)


# -- (A) the layer profile -------------------------------------------------------------------------
def profile_at(model: nn.Module, data: TensorDataset, batch: int, repeats: int) -> Profile:
    """``pipetrain.profile`` of ``model`` on the first ``batch`` samples, with the runs' SGD step per layer
    and building a minibatch from ``data`` timed (as ``stages="auto"`` profiles)."""
    x, y = data.tensors[0][:batch], data.tensors[1][:batch]
    profile = pipetrain.profile(model, (x, y), F.cross_entropy, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                                repeats=repeats, warmup=3)
    profile.inputs_s, profile.targets_s, profile.both_s = time_batching(data, batch, repeats)
    return profile


def measured_setup(model: nn.Module, data: TensorDataset, batch: int, workers: int) -> Setup:
    """The run set-up of ``workers`` one-thread workers, one training step at ``batch`` as their shared work
    (:func:`pipetrain.setup.measure_setup`, as ``stages="auto"`` measures it)."""
    x, y = data.tensors[0][:batch], data.tensors[1][:batch]
    return measure_setup(workers, 1, model_step(model, (x, y), F.cross_entropy))


def balanced_cut(profile: Profile, stages: int = 2) -> list[int]:
    """Boundaries minimising the slowest stage's forward+backward (exhaustive; fine for 2-4 stages)."""
    n = len(profile)
    t = [l.compute_s for l in profile.layers]
    best: tuple[float, list[int]] = (math.inf, [])
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts]
        worst = max(sum(t[a:b]) for a, b in zip(bounds, [*cuts, n]))
        best = min(best, (worst, bounds))
    return best[1]


def time_update(model: nn.Sequential, boundaries: list[int], repeats: int) -> list[float]:
    """Median seconds of one SGD step + ``zero_grad(set_to_none=True)`` per stage, as the runtime's ``U``.

    Gradients are set before each step, as a backward would (their allocation is in the profile's
    backward, which also allocates the gradients it returns).
    """
    out = []
    for a, b in zip(boundaries, [*boundaries[1:], len(model)]):
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


def from_layer_profile(cfg: Config, schedule: str, m: int, profiles: dict[int, Profile],
                       boundaries: list[int]) -> Prediction:
    """(A): ``profiles[m]`` (:func:`pipetrain.profiling.as_minibatch` for m > 1) with its set-up: the links are the measured
    transport's, the optimizer steps the profile's."""
    return predict(cfg, schedule, m, profiles[m], boundaries, Link(), None)


# -- (B) and (C): stages measured in the runtime ---------------------------------------------------------
def _stage_profile(forward_backward: list[tuple[float, float]], m: int, cut_bytes: int, batch: int,
                   what: str) -> Profile:
    """One layer per stage from each stage's seconds per (micro)batch, scaled by ``m`` as
    :func:`pipetrain.profiling.as_minibatch` does; the cut carries ``cut_bytes`` per minibatch."""
    n = len(forward_backward)
    layers = [LayerProfile(f"stage {s}", f * m, b * m, cut_bytes if s < n - 1 else 0, 0)
              for s, (f, b) in enumerate(forward_backward)]
    return Profile(layers, batch, "cpu", what)


def from_replay(cfg: Config, schedule: str, m: int, stages: list[dict[str, float]], cut_bytes: int,
                link: Link) -> Prediction:
    """(B): each stage's median F, B and (mean over stages) U from its replay (ms, as
    :func:`simreal.runs.replay` gives them)."""
    profile = _stage_profile([(s["F"] / 1e3, s["B"] / 1e3) for s in stages], m, cut_bytes, cfg.batch,
                             "wide_mlp stages, replayed")
    return predict(cfg, schedule, m, profile, list(range(len(stages))), link,
                   statistics.mean(s["U"] for s in stages) / 1e3)


def from_real_times(cfg: Config, traces: list[list[Record]], schedule: str, m: int, link: Link,
                    cut_bytes: int) -> tuple[Prediction, Link]:
    """(C): the simulator fed a real run's own action times: a consistency check of its timing rules.

    Each stage gets the mean F, B (per microbatch) and U of its worker over the measured steps
    (means: a pipeline's rate follows the sum of its times, not their median), and every transfer the
    mean delivery time measured in that run (:func:`pipetrain.trace.deliveries`; the link keeps the
    measured bandwidth, latency absorbs the rest). What remains of the error is the simulator's own:
    its dependency and timing rules, and constants standing for varying times.
    """
    mean = {kind: [statistics.mean(durations(t, kind, cfg.measured)) for t in traces] for kind in ("F", "B", "U")}
    profile = _stage_profile(list(zip(mean["F"], mean["B"])), m, cut_bytes, cfg.batch, "real action times")
    delivered = delivery_s(traces, schedule, m, cfg.minibatches)
    latency = max(0.0, delivered - cut_bytes / m / link.bandwidth_Bps) if delivered == delivered else link.latency_s
    real_link = Link(link.bandwidth_Bps, latency)
    return predict(cfg, schedule, m, profile, list(range(len(traces))), real_link,
                   statistics.mean(mean["U"])), real_link


def delivery_s(traces: list[list[Record]], schedule: str, m: int, minibatches: int) -> float:
    """Mean seconds from a send being queued to its receive returning (receiver already waiting) in a
    real run of ``schedule``; nan when no message qualifies."""
    times = deliveries(traces, build_schedule(schedule_of(schedule, m), [1] * len(traces), minibatches))
    return statistics.mean(times) if times else math.nan
