"""Reporting: the markdown tables and lines printed, and the timeline PNGs."""
from __future__ import annotations

import math
import os
import platform
from pathlib import Path
from typing import Any

import torch

from pipetrain.profiling import Profile
from pipetrain.simulate import Link
from pipetrain.trace import draw_timeline

from simreal.diagnose import KINDS
from simreal.workload import Config


def name(schedule: str, m: int) -> str:
    """``gpipe (4 microbatches)``, or the bare name."""
    return schedule + (f" ({m} microbatches)" if m > 1 else "")


def stage_sums(profile: Profile, stage_layers: list[tuple[int, int]]) -> list[tuple[float, float]]:
    """Per stage, the profile's forward and backward seconds."""
    return [(sum(l.forward_s for l in profile.layers[a:b + 1]), sum(l.backward_s for l in profile.layers[a:b + 1]))
            for a, b in stage_layers]


def profiles(by_batch: dict[int, Profile], stage_layers: list[tuple[int, int]], update: list[float],
             extras: dict[str, Any], corun: dict[int, float]) -> None:
    """Per stage, the layer profile at each batch size; the optimizer step and the runtime's extras."""
    print("\n| layer profile, 1 thread, ms per (micro)batch | stage 0 F / B | stage 1 F / B |\n|---|---|---|")
    for b, pr in by_batch.items():
        cells = " | ".join(f"{f * 1e3:.2f} / {bw * 1e3:.2f}" for f, bw in stage_sums(pr, stage_layers))
        print(f"| batch {b} | {cells} |")
    print(f"\noptimizer step (U) per stage {', '.join(f'{u * 1e3:.2f}' for u in update)} ms -> update_s "
          f"{sum(update) / len(update) * 1e3:.2f} ms. Not in the layer profile, priced from the set-up's copy and add "
          f"per byte: pipedream's weight stash copy per "
          f"minibatch ({', '.join(f'{c * 1e3:.2f}' for c in extras['stash_copy_s'])} ms per stage); adding one "
          f"microbatch's gradients into .grad ({', '.join(f'{c * 1e3:.2f}' for c in extras['accumulate_s'])} "
          f"ms per stage). Building a minibatch from the dataset, priced on the first F of each minibatch: "
          f"{_batching(by_batch)}. One minor "
          f"page fault costs {extras['page_fault_us']:.2f} µs.")
    print("CPU time of stage 0's F+B while stage 1's F+B runs in another process, over alone: " +
          ", ".join(f"{v:.3f} at batch {b}" for b, v in corun.items()))


def _batching(by_batch: dict[int, Profile]) -> str:
    """The profiles' times to build a minibatch's inputs and targets, in ms."""
    return ", ".join(f"{p.inputs_s * 1e3:.2f} / {p.targets_s * 1e3:.2f} ms at batch {b}" for b, p in by_batch.items())


def link(link: Link, raw: dict[str, Any], foreign: float) -> None:
    """The ping-pong's one-way times, the Link made of them, and the CPU per message."""
    print("link (gloo on loopback, through the runtime's Transport), one way: " + ", ".join(
        f"{n / 1e3:.0f} KB {i * 1e6:.0f} µs ({bz * 1e6:.0f} µs with both cores computing)"
        for n, i, bz in zip(raw["sizes"], raw["one_way_idle_s"], raw["one_way_busy_s"]))
        + f" -> Link(latency {link.latency_s * 1e6:.0f} µs, bandwidth {link.bandwidth_Bps / 1e9:.2f} GB/s) "
          f"from the idle ones; other processes used {foreign:.2f} cores. CPU per message, per end "
          f"(all threads of a process): " + ", ".join(f"{n / 1e3:.0f} KB {c * 1e6:.0f} µs" for n, c in
                                                      zip(raw["sizes"], raw["cpu_per_message_end_s"])))


def replays(cfg: Config, chosen: dict[str, list[dict[str, float]]], by_m: dict[int, Profile],
            stage_layers: list[tuple[int, int]]) -> None:
    """Each stage's replayed F / B / U beside the layer profile, per schedule."""
    print("\nEach stage's worker replayed alone (the runtime's Worker, receives instant), ms per (micro)batch, "
          "vs the layer profile:\n")
    print("| schedule | stage 0 F / B / U | stage 1 F / B / U | layer profile: stage 0 F / B; stage 1 F / B |")
    print("|---|---|---|---|")
    for schedule, m in cfg.schedules:
        cells = " | ".join(f"{md['F']:.2f} / {md['B']:.2f} / {md['U']:.2f}" for md in chosen[schedule])
        ref = "; ".join(f"{f * 1e3 / m:.2f} / {b * 1e3 / m:.2f}" for f, b in stage_sums(by_m[m], stage_layers))
        print(f"| {name(schedule, m)} | {cells} | {ref} |")


def predictions(cfg: Config, rows: list[dict[str, Any]], stages: int, link_raw: dict[str, Any]) -> None:
    """(A) and (B) against the measurement; (C) against its own run."""
    print(f"\n## {stages} stages on {os.cpu_count()} cores, batch {cfg.batch}, {cfg.minibatches} minibatches "
          f"per run, median of steps {cfg.skip + 1}..{cfg.measured.stop}, median of {cfg.reps} run(s)\n")
    print("Predicted from (A) the layer profile (pipetrain.profile, one process, 1 thread) with its run set-up (the "
          "median over a pair taken before each repetition's runs) and (B) each stage's worker replayed alone with the runtime's own "
          "code; both with the idle ping-pong link:\n")
    print("| schedule | predicted (A) | predicted (B) | measured samples/s | error (A) % | error (B) % | other "
          "processes during the measured steps, cores |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {name(r['schedule'], r['microbatches'])} | {r['predicted']:.0f} | {r['predicted_replay']:.0f} | "
              f"{r['measured']:.0f} | {r['error_pct']:+.1f} | {r['error_replay_pct']:+.1f} | "
              f"{', '.join(f'{c:.2f}' for c in r['foreign_cores'])} |")
    print("\n(A) from each profile and set-up: " + "; ".join(
        f"{name(r['schedule'], r['microbatches'])} {', '.join(f'{x:.0f}' for x in r['predicted_runs'])}" for r in rows))
    print("\nThe simulator's rules checked: (C) fed the real run's own mean F, B, U per worker and its mean "
          "message delivery time (send queued -> receive returned, receiver already waiting):\n")
    print("| schedule | one message, ms: link model / ping-pong with both cores busy / delivered in the run | "
          "that run, samples/s | (C) | error (C) % |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        busy_ms = 1e3 * link_raw["one_way_busy_s"][1 if r["microbatches"] > 1 else 2]
        print(f"| {name(r['schedule'], r['microbatches'])} | {r['link_model_ms']:.2f} / {busy_ms:.2f} / "
              f"{r['delivery_ms']:.2f} | {r['run_measured']:.0f} | {r['predicted_real_times']:.0f} | "
              f"{r['error_real_times_pct']:+.1f} |")


def budgets(rows: list[dict[str, Any]], chosen: dict[str, list[dict[str, float]]]) -> None:
    """ms per step by action kind (real / A / B), and CPU and page faults per step (real / replayed)."""
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
        for w, md in enumerate(chosen[r["schedule"]]):
            real = r["workers_real"][w] if w < len(r["workers_real"]) else nan
            print(f"| {r['schedule']} | {w} | {real['cpu_ms']:.1f} | {real['main_ms']:.1f} + {real['gloo_ms']:.1f} + "
                  f"{real['other_ms']:.1f} | {md['cpu_ms']:.1f} | {real['faults']:.0f} / {md['faults']:.0f} |")


def pngs(cfg: Config, row: dict[str, Any], boundaries: list[int], png_dir: Path) -> list[str]:
    """Timelines of ``row``'s median real run (local workers share CLOCK_MONOTONIC: one offset) and of
    its simulation (A)."""
    png_dir.mkdir(parents=True, exist_ok=True)
    real = row["_real_trace"]
    start = min(t[0][1] for t in real if t)
    names = [f"worker {w} (stage {w})" for w in range(len(real))]
    title = (f"{row['schedule']}, MLP {cfg.depth}x{cfg.width}, batch {cfg.batch}, stages {boundaries}, "
             f"{len(boundaries)} cores")
    paths = [png_dir / "sim_vs_real_measured.png", png_dir / "sim_vs_real_simulated.png"]
    draw_timeline(real, paths[0], names=names, offsets=[start] * len(real),
                  title=f"{title}: measured, {row['measured']:.0f} samples/s")
    draw_timeline(row["_sim_trace"], paths[1], names=names,
                  title=f"{title}: simulated from the layer profile, {row['predicted']:.0f} samples/s")
    print(f"\nwrote {paths[0]} and {paths[1]}")
    return [str(p) for p in paths]


def tracing(t: dict[str, Any], pairs: int) -> None:
    """Samples/s with tracing off and on, and one record's cost."""
    print(f"\ntracing, pipedream, {pairs} alternating pairs, median samples/s: off "
          f"{t['median_off']:.0f} {[round(x) for x in t['off']]}, on {t['median_on']:.0f} "
          f"{[round(x) for x in t['on']]} -> overhead {t['overhead_pct']:+.2f}%; both workers' CPU per step "
          f"{t['cpu_ms_per_step_off']:.1f} ms off, {t['cpu_ms_per_step_on']:.1f} ms on; other processes, cores: off "
          f"{', '.join(f'{c:.2f}' for c in t['foreign_off'])}, on {', '.join(f'{c:.2f}' for c in t['foreign_on'])}")
    print(f"one trace record costs {t['per_record_us']:.2f} µs (tight loop of the runtime's record code); "
          f"{t['records_per_step_per_worker']:.0f} records per worker per {t['step_ms']:.0f} ms step -> "
          f"{t['expected_overhead_pct']:.4f}% expected")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {"cores": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__,
            "python": platform.python_version()}
