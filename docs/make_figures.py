"""Regenerate the pictures in docs/: ``python docs/make_figures.py`` (about a minute, CPU only).

figure8.png: the simulated timeline of PipeDream's Figure 8 (PipeDream §3.3): a straight 4-stage
pipeline under the ``pipedream`` (1F1B) schedule, NOAM = 4, equal stages with backward = 2 x forward,
free communication, 10 minibatches.

schedule_<name>_simulated.png: ``1f1b-flush``, ``zero-bubble``, ``2bw`` and ``interleaved-1f1b`` simulated
on 4 workers with equal stages (forward 1 ms, backward 2 ms of which the weight gradient 1 ms, free
links), 2 minibatches of 8 microbatches (``2bw``: 4 minibatches of 4); ``interleaved-1f1b`` holds 8
stages of half that work, two per worker.

schedule_<name>_traced.png: the same schedules run for real by ``pipetrain.train`` on 2 workers (a
float32 MLP of 8 layers of width 512, batch 64, 4 microbatches, one torch thread each) and traced.
"""
from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import Interleaved1F1B, OneFOneBFlush, PipelineSchedule, TwoBW, ZeroBubble, build_schedule
from pipetrain.simulate import simulate
from pipetrain.trace import draw_timeline

DOCS = Path(__file__).resolve().parent


def figure8(path: Path = DOCS / "figure8.png") -> None:
    """4 equal stages (forward 1 ms, backward 2 ms), ``pipedream`` schedule, 10 minibatches."""
    profile = Profile([LayerProfile(f"layer{i}", 1e-3, 2e-3, 0, 0) for i in range(4)],
                      batch_size=1, device="synthetic")
    schedule = build_schedule("pipedream", [1, 1, 1, 1], 10)
    result = simulate(schedule, profile, [0, 1, 2, 3])
    draw_timeline(result.trace, path, names=[f"worker {w} (stage {w})" for w in range(4)],
                  title=f"pipedream (1F1B), 4 stages, NOAM {schedule.noam}: simulated "
                        f"(forward 1 ms, backward 2 ms, free links)")
    print(f"wrote {path}: {result.minibatches_per_s:.0f} minibatches/s steady state, "
          f"bubble {result.bubble_fraction:.2f}, weight versions {result.peak_weight_versions}")


def simulated_schedules() -> None:
    """The new schedules' simulated timelines beside 1f1b-flush's, with their bubbles."""
    cases: list[tuple[str, PipelineSchedule, int, int]] = [
        ("1f1b-flush", OneFOneBFlush(microbatches=8), 4, 2), ("zero-bubble", ZeroBubble(microbatches=8), 4, 2),
        ("2bw", TwoBW(microbatches=4), 4, 4), ("interleaved-1f1b", Interleaved1F1B(microbatches=8, workers=4), 8, 2)]
    for name, schedule, stages, minibatches in cases:
        share = 4 / stages  # the same work per worker, however many stages it holds
        profile = Profile([LayerProfile(f"layer{i}", 1e-3 * share, 2e-3 * share, 0, 0, weight_backward_s=1e-3 * share)
                           for i in range(stages)], batch_size=1, device="synthetic")
        built = schedule.build([1] * stages, minibatches)
        result = simulate(built, profile, list(range(stages)))
        path = DOCS / f"schedule_{name}_simulated.png"
        held = [built.stages_of(w) for w in range(built.num_workers)]
        names = [f"worker {w} (stage{'s' * (len(h) > 1)} {', '.join(map(str, h))})" for w, h in enumerate(held)]
        draw_timeline(result.trace, path, names=names,
                      title=f"{name}, {built.microbatches} microbatches: simulated (bubble {result.bubble_fraction:.2f})")
        print(f"wrote {path}: bubble {result.bubble_fraction:.3f}, weight versions {result.peak_weight_versions}")


def traced_schedules() -> None:
    """The new schedules run for real on 2 workers, their traced timelines."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(512, 512) if i % 2 == 0 else nn.ReLU() for i in range(8)]
    data = TensorDataset(torch.randn(64 * 6, 512), torch.randn(64 * 6, 512))
    cases: list[tuple[str, PipelineSchedule, list[int]]] = [
        ("1f1b-flush", OneFOneBFlush(microbatches=4), [0, 4]), ("zero-bubble", ZeroBubble(microbatches=4), [0, 4]),
        ("2bw", TwoBW(microbatches=4), [0, 4]), ("interleaved-1f1b", Interleaved1F1B(microbatches=4), [0, 2, 4, 6])]
    for name, schedule, stages in cases:
        with tempfile.TemporaryDirectory() as out:
            pipetrain.train(nn.Sequential(*layers), data, loss_fn=nn.functional.mse_loss,
                            optimizer=functools.partial(torch.optim.SGD, lr=0.01), schedule=schedule, stages=stages,
                            workers=2 if len(stages) > 2 else None, batch_size=64, shuffle=False, threads=1,
                            trace=out)
            path = DOCS / f"schedule_{name}_traced.png"
            shutil.copy(Path(out) / "timeline.png", path)
        print(f"wrote {path}")


if __name__ == "__main__":
    figure8()
    simulated_schedules()
    traced_schedules()
