"""Regenerate the pictures in docs/: ``python docs/make_figures.py`` (a few seconds, CPU only).

figure8.png: the simulated timeline of PipeDream's Figure 8 (PipeDream §3.3): a straight 4-stage
pipeline under the ``pipedream`` (1F1B) schedule, NOAM = 4, equal stages with backward = 2 x forward,
free communication, 10 minibatches.
"""
from __future__ import annotations

from pathlib import Path

from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import build_schedule
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


if __name__ == "__main__":
    figure8()
