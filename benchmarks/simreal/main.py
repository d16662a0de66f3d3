"""The whole benchmark: measure, predict, report, and the JSON of every number (the package docstring says what
and why)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipetrain.bench.load import LoadSampler, quietly
from pipetrain.profiling import Profile, as_minibatch
from pipetrain.registry import build_schedule
from pipetrain.setup import Setup

from simreal import diagnose, predict, report
from simreal.link import measure_link
from simreal.runs import real_run, record_cost_us, replay
from simreal.workload import PRESETS, Config, make_data, wide_mlp

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class Patience:
    """A budget of seconds for waiting on other processes and for repeating disturbed measurements."""

    def __init__(self, wait_s: float, attempts: int, budget_s: float) -> None:
        self.wait_s, self.attempts, self.deadline = wait_s, attempts, time.monotonic() + budget_s

    def __call__(self, fn: Callable[[LoadSampler], T], what: str,
                 foreign: Callable[[T, LoadSampler], float] | None = None) -> tuple[T, float]:
        left = self.deadline - time.monotonic()
        return quietly(fn, self.attempts if left > 0 else 1, min(self.wait_s, max(left, 0.0)), what, foreign=foreign)


def _measured_foreign(result: dict[str, Any], _: LoadSampler) -> float:
    return result["foreign_cores"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Simulator vs real runs: does pipetrain.simulate predict "
                                             "what pipetrain.train measures?")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="24 minibatches per run, 1 run per schedule, 2 tracing pairs, no waiting (< 3 min)")
    size.add_argument("--smoke", action="store_true",
                      help="a tiny MLP (2 x 64 wide, batch 32, 8 minibatches), 1 run each, no waiting: checks the "
                           "script end to end in seconds; its numbers mean nothing")
    ap.add_argument("--png-dir", type=Path, default=None,
                    help="where to write sim_vs_real_{measured,simulated}.png (default: docs/ for a full "
                         "run, none for --quick and --smoke)")
    ap.add_argument("--json", type=Path, default=None, help="also write every number to this JSON file")
    ap.add_argument("--patience", type=float, default=None,
                    help="seconds in all to spend waiting for other processes to go quiet and repeating "
                         "disturbed measurements (default 900; 0 with --quick and --smoke); see [Note: foreign "
                         "load] in pipetrain/bench/load.py")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    short = args.quick or args.smoke
    cfg = PRESETS["smoke" if args.smoke else "quick" if args.quick else "full"]
    png_dir = args.png_dir if args.png_dir is not None else (None if short else ROOT / "docs")
    patience = Patience(wait_s=60.0, attempts=4,
                        budget_s=args.patience if args.patience is not None else (0.0 if short else 900.0))
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    print(f"# {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, python "
          f"{platform.python_version()}; load average {os.getloadavg()[0]:.2f}")
    data = make_data(cfg)
    model = wide_mlp(cfg)

    # 1. profiles, in this one process with 1 thread, like every worker
    def take_profiles(_: LoadSampler) -> dict[str, Any]:
        prof = predict.profile_at(model, data, cfg.batch, cfg.repeats)
        bounds = predict.balanced_cut(prof)
        return {"prof": prof, "prof_micro": predict.profile_at(model, data, cfg.batch // cfg.micro, cfg.repeats),
                "boundaries": bounds, "update": predict.time_update(model, bounds, cfg.repeats),
                "extras": diagnose.time_runtime_extras(model, bounds, cfg.repeats)}

    p, prof_foreign = patience(take_profiles, "profiles")
    prof, prof_micro, boundaries, update, extras = (p[k] for k in ("prof", "prof_micro", "boundaries", "update",
                                                                    "extras"))
    # the set-up's shared work is a training step at the size the workers run: a minibatch, or a microbatch
    (setup, setup_micro), _ = patience(lambda _: _setups(cfg, model, data, len(boundaries)), "set-ups")
    print(f"run set-up: {setup.describe()}\nat the microbatch ({cfg.batch // cfg.micro}): {setup_micro.describe()}")
    stage_layers = [(a, b - 1) for a, b in zip(boundaries, [*boundaries[1:], len(prof)])]
    by_m = _by_microbatches(cfg, prof, prof_micro, setup, setup_micro)
    profiles = [by_m]  # (A)'s profiles: this one, then one more before each later repetition's runs
    corun = {b: diagnose.corun_slowdown(cfg, model, stage_layers, b) for b in (cfg.batch, cfg.batch // cfg.micro)}
    print(f"stages {boundaries} (layers {stage_layers} of {len(prof)}), the cut that balances the profile; "
          f"other processes used {prof_foreign:.2f} cores while profiling")
    report.profiles({cfg.batch: prof, cfg.batch // cfg.micro: prof_micro}, stage_layers, update, extras, corun)

    # 2. the link
    cut_bytes = prof.layers[boundaries[1] - 1].activation_bytes
    (link, link_raw), link_foreign = patience(lambda _: measure_link(cfg, cut_bytes), "link")
    report.link(link, link_raw, link_foreign)

    # 3. per repetition and schedule: each stage's worker replayed alone, then the real run; close in
    # time, so drifts in the machine's speed hit both, and interleaved over schedules
    print()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s, _ in cfg.schedules}
    replays: dict[str, list[list[dict[str, float]]]] = {s: [] for s, _ in cfg.schedules}
    for rep in range(cfg.reps):
        if rep:
            more, _ = patience(lambda _: _inputs_again(cfg, model, data, len(boundaries)), f"profiles {rep + 1}")
            profiles.append(more)
            print(f"  (A)'s inputs again: {_steps(cfg, more)}")
        for schedule, m in cfg.schedules:
            rp, _ = patience(lambda _: replay(cfg, boundaries, schedule, m), f"replay {schedule}")
            replays[schedule].append(rp)
            r, _ = patience(lambda ls: real_run(cfg, data, boundaries, schedule, m, True, ls), schedule,
                            foreign=_measured_foreign)
            runs[schedule].append(r)
            print(f"  run {rep + 1}/{cfg.reps} {schedule:14s} {r['samples_per_s']:6.0f} samples/s (other processes "
                  f"{r['foreign_cores']:.2f} cores during the measured steps, load average {os.getloadavg()[0]:.2f})")
    # per schedule, the repetition whose real run is the median one, and its replay
    median_rep = {}
    for schedule, _ in cfg.schedules:
        measured = statistics.median(r["samples_per_s"] for r in runs[schedule])
        median_rep[schedule] = min(range(cfg.reps), key=lambda i: abs(runs[schedule][i]["samples_per_s"] - measured))
    chosen = {s: replays[s][k] for s, k in median_rep.items()}
    report.replays(cfg, chosen, by_m, stage_layers)

    # 4. simulate the same action lists
    rows = []
    for schedule, m in cfg.schedules:
        # (A) from each repetition's profile, as the runs are taken: the median, as of the runs
        each = [predict.from_layer_profile(cfg, schedule, m, p, boundaries) for p in profiles]
        a_rate = statistics.median(x.samples_per_s for x in each)
        a = min(each, key=lambda x: abs(x.samples_per_s - a_rate))
        bs = [predict.from_replay(cfg, schedule, m, stages, cut_bytes, link) for stages in replays[schedule]]
        pred_b = statistics.median(b.samples_per_s for b in bs)
        measured = statistics.median(r["samples_per_s"] for r in runs[schedule])
        k = median_rep[schedule]
        run = runs[schedule][k]
        c, _ = predict.from_real_times(cfg, run["traces"], schedule, m, link, cut_bytes)
        rows.append({"schedule": schedule, "microbatches": m, "predicted": a_rate,
                     "predicted_runs": [x.samples_per_s for x in each],
                     "predicted_sim_samples_per_s": a.sim_samples_per_s, "measured": measured,
                     "measured_runs": [r["samples_per_s"] for r in runs[schedule]],
                     "error_pct": 100 * (a_rate - measured) / measured, "predicted_replay": pred_b,
                     "error_replay_pct": 100 * (pred_b - measured) / measured,
                     "predicted_replay_runs": [b.samples_per_s for b in bs],
                     "predicted_real_times": c.samples_per_s, "run_measured": run["samples_per_s"],
                     "error_real_times_pct": 100 * (c.samples_per_s - run["samples_per_s"]) / run["samples_per_s"],
                     "delivery_ms": 1e3 * predict.delivery_s(run["traces"], schedule, m, cfg.minibatches),
                     "link_model_ms": 1e3 * link.transfer_s(cut_bytes / m),
                     "foreign_cores": [r["foreign_cores"] for r in runs[schedule]],
                     "workers_real": run["workers"],
                     "budget_real": diagnose.budget(cfg, run["traces"]),
                     "budget_sim": diagnose.budget(cfg, a.trace),
                     "budget_replay": diagnose.budget(cfg, bs[k].trace),
                     "_sim_trace": a.trace, "_real_trace": run["traces"]})
    report.predictions(cfg, rows, len(boundaries), link_raw)
    report.budgets(rows, chosen)
    pngs = report.pngs(cfg, rows[0], boundaries, png_dir) if png_dir is not None else []

    # 5. the cost of tracing: off and on alternating, so drifts in the machine's load hit both alike
    tracing = _tracing_cost(cfg, data, boundaries, patience)
    report.tracing(tracing, cfg.trace_pairs)
    elapsed = time.perf_counter() - t_start
    print(f"\n# load average at the end {os.getloadavg()[0]:.2f}; took {elapsed:.0f} s")

    out = {"machine": report.machine(),
           "config": {"width": cfg.width, "depth": cfg.depth, "batch": cfg.batch, "microbatches": cfg.micro,
                      "minibatches": cfg.minibatches, "skip": cfg.skip, "tail": cfg.tail, "reps": cfg.reps,
                      "boundaries": boundaries, "quick": args.quick, "smoke": args.smoke},
           "profile_foreign_cores": prof_foreign, "update_s": update, "extras": extras,
           "setup": dataclasses.asdict(setup), "setup_micro": dataclasses.asdict(setup_micro),
           "setup_steps_ms": [{cfg.batch // m: 1e3 * p.setup.step_s for m, p in by.items() if p.setup is not None}
                              for by in profiles],
           "corun_cpu_slowdown": corun, "elapsed_s": elapsed,
           "link": {"bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s, **link_raw,
                    "foreign_cores": link_foreign},
           "stage_profile_ms": {k: [[1e3 * v for v in fb] for fb in report.stage_sums(p, stage_layers)]
                                for k, p in [("batch", prof), (f"micro_x{cfg.micro}", by_m[cfg.micro])]},
           "replay_ms": chosen,
           "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
           "tracing": tracing, "pngs": pngs}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


def _inputs_again(cfg: Config, model: nn.Module, data: TensorDataset, workers: int) -> dict[int, Profile]:
    """(A)'s profiles by microbatches, taken again with their run set-ups: the layer profile and the
    set-up at the minibatch, and at the microbatch scaled up to it. A profile and a set-up read the
    machine's speed in the seconds they take, as a run does, so they are taken as often as the runs are."""
    return _by_microbatches(cfg, predict.profile_at(model, data, cfg.batch, cfg.repeats),
                            predict.profile_at(model, data, cfg.batch // cfg.micro, cfg.repeats),
                            *_setups(cfg, model, data, workers))


def _setups(cfg: Config, model: nn.Module, data: TensorDataset, workers: int) -> tuple[Setup, Setup]:
    """The run set-ups of ``workers`` workers whose shared work is a training step at the minibatch, and
    at the microbatch (:func:`simreal.predict.measured_setup`)."""
    return (predict.measured_setup(model, data, cfg.batch, workers),
            predict.measured_setup(model, data, cfg.batch // cfg.micro, workers))


def _steps(cfg: Config, by_m: dict[int, Profile]) -> str:
    """The set-ups' training steps of ``by_m`` against its layers summed, at the minibatch and the microbatch."""
    parts = []
    for m, prof in sorted(by_m.items()):
        assert prof.setup is not None
        rows = cfg.batch // m
        layers = sum(layer.compute_s for layer in prof.layers) / m
        parts.append(f"{rows} rows: step {1e3 * prof.setup.step_s:.1f} ms, layers {1e3 * layers:.1f} ms")
    return "; ".join(parts)


def _by_microbatches(cfg: Config, prof: Profile, micro: Profile, setup: Setup,
                     setup_micro: Setup) -> dict[int, Profile]:
    """(A)'s profiles by microbatches: ``prof`` at the minibatch, ``micro`` at the microbatch scaled up
    to it, each given its run set-up."""
    prof.setup, micro.setup = setup, setup_micro
    return {1: prof, cfg.micro: as_minibatch(micro, cfg.micro)}


def _tracing_cost(cfg: Config, data: TensorDataset, boundaries: list[int], patience: Patience) -> dict[str, Any]:
    """``pipedream`` runs with tracing off and on, alternating, and one trace record timed directly."""
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(cfg.trace_pairs):
        for flag in (False, True):
            r, _ = patience(lambda ls: real_run(cfg, data, boundaries, "pipedream", 1, flag, ls),
                            f"pipedream, trace={flag}", foreign=_measured_foreign)
            runs[flag].append(r)
    off = [r["samples_per_s"] for r in runs[False]]
    on = [r["samples_per_s"] for r in runs[True]]
    cpu = {flag: statistics.median(sum(w["cpu_ms"] for w in r["workers"]) for r in rs) for flag, rs in runs.items()}
    sched = build_schedule("pipedream", [1] * len(boundaries), cfg.minibatches)
    per_record = record_cost_us([a for acts in sched.actions for a in acts] * 200)
    records_per_step = sum(len(a) for a in sched.actions) / cfg.minibatches / len(sched.actions)
    step_ms = 1e3 * cfg.batch / statistics.median(off)
    return {"off": off, "on": on, "median_off": statistics.median(off), "median_on": statistics.median(on),
            "overhead_pct": 100 * (statistics.median(off) - statistics.median(on)) / statistics.median(off),
            "foreign_off": [r["foreign_cores"] for r in runs[False]],
            "foreign_on": [r["foreign_cores"] for r in runs[True]],
            "cpu_ms_per_step_off": cpu[False], "cpu_ms_per_step_on": cpu[True],
            "per_record_us": per_record, "records_per_step_per_worker": records_per_step, "step_ms": step_ms,
            "expected_overhead_pct": 100 * per_record * 1e-3 * records_per_step / step_ms}
