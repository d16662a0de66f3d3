"""The tables and the verdict, from the numbers the two runs return.

Both systems' start-up is timed alike, on the job's clock: *load* from starting the workers until
every one holds its stage (pipetrain's ``phases["start_s"]``), *first update* from then until the last
stage's first update (``phases["first_update_s"]``); a torch rank's own times are shown beside.
"""
from __future__ import annotations

from typing import Any

GIB = 2**30


def torch_phases(run: dict[str, Any]) -> dict[str, float]:
    """torch's job times as pipetrain's ``phases`` measure its own."""
    ranks = run["ranks"]
    ready = max(r["ready"] for r in ranks)
    return {"start_s": ready - run["launched"], "first_update_s": ranks[-1]["times"][0] - ready}


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
    for r in theirs["ranks"]:
        rows.append(f"| torch.distributed.pipelining | {r['rank']} | {r['peak_memory'] / GIB:.2f} | | "
                    f"{r['ready'] - theirs['launched']:.1f} | {r['times'][0] - r['ready']:.2f} | - |")
    t = torch_phases(theirs)
    rows.append(f"| torch.distributed.pipelining | job | {max(r['peak_memory'] for r in theirs['ranks']) / GIB:.2f} "
                f"(most) | | {t['start_s']:.1f} | {t['first_update_s']:.2f} | - |")
    return "\n".join(rows)


NOISE = 0.05
"""Measures within 5% count as equal in the verdict: peak memory and start-up vary by that much from
run to run on a shared machine."""


def verdict(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[bool, str]:
    """Whether pipetrain's every rank peaks no higher than torch's same rank and its job starts (load and
    first update) no later, within :data:`NOISE`; the line that says so, and where not."""
    misses = [f"rank {r['rank']} peaks at {mine / GIB:.2f} GiB against {r['peak_memory'] / GIB:.2f}"
              for mine, r in zip(ours["peak_memory"], theirs["ranks"]) if mine > (1 + NOISE) * r["peak_memory"]]
    start = ours["phases"]["start_s"] + ours["phases"]["first_update_s"]
    t = torch_phases(theirs)
    against = t["start_s"] + t["first_update_s"]
    if start > (1 + NOISE) * against:
        misses.append(f"its first update comes {start:.1f} s after the start against {against:.1f} s")
    line = f"pipetrain <= torch on per-rank peak memory and start-up (within {NOISE:.0%}): " + \
        ("yes" if not misses else "no (" + "; ".join(misses) + ")")
    return not misses, line


def largest_table(rows: list[dict[str, Any]]) -> str:
    """``--largest``: per size, whether pipetrain's job trained, its peak memory and times."""
    lines = ["| size | parameters | trained | most peak memory GiB | load s | first update s | save s |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        run = row.get("pipetrain")
        if run is None:
            lines.append(f"| {row['size']} | {row['parameters'] / 1e9:.2f} B | no: {row['error']} | | | | |")
            continue
        p = run["phases"]
        lines.append(f"| {row['size']} | {row['parameters'] / 1e9:.2f} B | yes | {max(run['peak_memory']) / GIB:.2f} | "
                     f"{p['start_s']:.1f} | {p['first_update_s']:.2f} | {p['save_s']:.2f} |")
    return "\n".join(lines)
