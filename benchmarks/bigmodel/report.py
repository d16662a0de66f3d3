"""The tables and the verdict, from the numbers the runs return, each the median of the runs.

Both systems' start-up is timed alike, on the job's clock: *load* from starting the workers until
every one holds its stage (pipetrain's ``phases["start_s"]``), *first update* from then until the last
stage's first update (``phases["first_update_s"]``); a torch rank's own times are shown beside.
"""
from __future__ import annotations

import statistics
from typing import Any

GIB = 2**30

NOISE = 0.05
"""Medians within 5% count as equal in the verdict: peak memory and start-up vary by more than that from
run to run on a shared machine."""


def ours_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """pipetrain's runs (:func:`bigmodel.ours.run_pipetrain`): per rank and per phase, the median."""
    return {"peak_memory": _per_rank([r["peak_memory"] for r in runs]),
            "predicted_memory": runs[0]["predicted_memory"],
            "phases": {k: statistics.median(r["phases"][k] for r in runs) for k in ("start_s", "first_update_s",
                                                                                   "save_s")}}


def torch_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's runs (:func:`bigmodel.torch_recipe.run_torch`) as :func:`ours_summary` has pipetrain's,
    with each rank's own load and first-update seconds."""
    def phases(run: dict[str, Any]) -> dict[str, float]:
        ranks = run["ranks"]
        ready = max(r["ready"] for r in ranks)
        return {"start_s": ready - run["launched"], "first_update_s": ranks[-1]["times"][0] - ready}

    return {"peak_memory": _per_rank([[r["peak_memory"] for r in run["ranks"]] for run in runs]),
            "load_s": _per_rank([[r["ready"] - run["launched"] for r in run["ranks"]] for run in runs]),
            "first_update_s": _per_rank([[r["times"][0] - r["ready"] for r in run["ranks"]] for run in runs]),
            "phases": {k: statistics.median(phases(run)[k] for run in runs) for k in ("start_s", "first_update_s")}}


def _per_rank(runs: list[list[float]]) -> list[float]:
    return [statistics.median(values) for values in zip(*runs)]


def table(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Per system and rank: peak memory, pipetrain's prediction, and the job's load, first-update and
    save seconds (each rank's own for torch)."""
    predicted = ours["predicted_memory"]
    rows = ["| system | rank | peak memory GiB | predicted GiB | load s | first update s | save s |",
            "|---|---|---|---|---|---|---|"]
    for rank, peak in enumerate(ours["peak_memory"]):
        guess = f"{predicted[rank] / GIB:.2f}" if predicted else "n/a"
        rows.append(f"| pipetrain | {rank} | {peak / GIB:.2f} | {guess} | | | |")
    p = ours["phases"]
    rows.append(f"| pipetrain | job | {max(ours['peak_memory']) / GIB:.2f} (most) | | {p['start_s']:.1f} | "
                f"{p['first_update_s']:.2f} | {p['save_s']:.2f} |")
    for rank, (peak, load, first) in enumerate(zip(theirs["peak_memory"], theirs["load_s"], theirs["first_update_s"])):
        rows.append(f"| torch.distributed.pipelining | {rank} | {peak / GIB:.2f} | | {load:.1f} | {first:.2f} | - |")
    t = theirs["phases"]
    rows.append(f"| torch.distributed.pipelining | job | {max(theirs['peak_memory']) / GIB:.2f} (most) | | "
                f"{t['start_s']:.1f} | {t['first_update_s']:.2f} | - |")
    return "\n".join(rows)


def verdict(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[bool, str]:
    """Whether pipetrain's every rank peaks no higher than torch's same rank and its job starts (load and
    first update) no later, within :data:`NOISE`; the line that says so, and where not."""
    misses = [f"rank {rank} peaks at {mine / GIB:.2f} GiB against {other / GIB:.2f}"
              for rank, (mine, other) in enumerate(zip(ours["peak_memory"], theirs["peak_memory"]))
              if mine > (1 + NOISE) * other]
    start, against = (sum(s["phases"][k] for k in ("start_s", "first_update_s")) for s in (ours, theirs))
    if start > (1 + NOISE) * against:
        misses.append(f"its first update comes {start:.1f} s after the start against {against:.1f} s")
    line = f"pipetrain <= torch on per-rank peak memory and start-up (medians within {NOISE:.0%}): " + \
        ("yes" if not misses else "no (" + "; ".join(misses) + ")")
    return not misses, line


def largest_table(rows: list[dict[str, Any]]) -> str:
    """``--largest``: per size, whether pipetrain's job trained, its peak memory and times."""
    lines = ["| size | parameters | trained | most peak memory GiB | load s | first update s | save s |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        run = row.get("pipetrain")
        if run is None:
            lines.append(f"| {row['size']} | {row['parameters']:,} | no: {row['error']} | | | | |")
            continue
        p = run["phases"]
        lines.append(f"| {row['size']} | {row['parameters']:,} | yes | {max(run['peak_memory']) / GIB:.2f} | "
                     f"{p['start_s']:.1f} | {p['first_update_s']:.2f} | {p['save_s']:.2f} |")
    return "\n".join(lines)
