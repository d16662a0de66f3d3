"""A bar chart of a side-by-side run's report: samples/s and bytes per sample per worker, per system."""
from __future__ import annotations

from typing import Any

from pipetrain.bench.systems import MICROBATCHED, PIPE_SGD, SYSTEMS


def plot(report: dict[str, Any], path: str) -> None:
    """Bars of samples/s (with the slowest-stage bound when a pipeline ran) and bytes per sample per
    worker, per system; pipetrain's in blue."""
    # imported where a chart is drawn: matplotlib takes a second or more to import, which every `pipetrain`
    # command would pay otherwise
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    cfg = report["config"]
    names = list(report["samples_per_s"])
    pipelines = SYSTEMS[:4]
    colours = ["#4c72b0" if n in (*pipelines, *PIPE_SGD, "cgdp") else "#dd8452" for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.8), sharey=True)
    y = range(len(names))
    rates = [report["samples_per_s"][n] for n in names]
    ax1.barh(y, rates, color=colours)
    for i, v in enumerate(rates):
        ax1.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    bound = report["bound_samples_per_s"] if any(n in pipelines for n in names) else 0.0
    if bound:
        ax1.axvline(bound, color="k", ls="--", lw=1)
        ax1.text(bound, len(names) - 0.4, " slowest-stage bound", fontsize=8)
    ax1.set_yticks(list(y), [f"{n} (x{report['microbatches'][n]})" if n in MICROBATCHED else n for n in names])
    ax1.invert_yaxis()
    ax1.set_xlabel("samples/s (higher is better)")
    ax1.set_xlim(0, max(max(rates), bound) * 1.2)
    sizes = [report["bytes_per_sample"][n] for n in names]
    ax2.barh(y, sizes, color=colours)
    ax2.set_xscale("log")
    ax2.set_xlim(min(sizes) / 10, max(sizes) * 10)
    for i, v in enumerate(sizes):
        ax2.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax2.set_xlabel("bytes sent per worker per sample (log; ps-sync: its server)")
    fig.suptitle(f"{cfg['model']}, {cfg['workers']} workers ({report['where']}), batch {cfg['batch_size']}: "
                 "pipetrain (blue) and baselines (orange)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
