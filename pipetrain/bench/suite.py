"""Running ``pipetrain bench``: every system of :mod:`pipetrain.bench.systems` side by side, each a
fresh job on the emulated cluster (or on loopback), then the measurements apart from the runs that the
report sets beside them.

The pipelines other than ``pipedream`` run on one *split* (first layer of each stage): ``--stages``
when given (then ``pipedream`` uses it too), else the automatic plan's when it is a straight pipeline,
else the planner's best straight pipeline for the same profile; the report says which. Microbatched
systems run at every count of ``--microbatches`` they accept and report their best, listing all.

Numbers per system: samples/s of the whole job (median over timed windows after warm-up; see
:mod:`pipetrain.bench.measure`), bytes each worker sends per sample (counted from tensor sizes; also
read from each host's interface on the emulated cluster; for ``ps-sync`` the server's, its busiest
link, with every rank's figure under ``bytes_per_sample_per_rank``), speedups. Beside them, the bound a
pipeline's slowest stage sets: each stage's forward + backward measured alone in this process with
the workers' thread count (median), bound = batch / slowest stage (its forward + backward, update and
weight copy). The pipedream run is traced, so
the report also gives each of its workers' seconds per minibatch in compute and in waiting. On the
emulated cluster each data-parallel system's samples/s is also predicted
(:func:`pipetrain.bench.predictions.predict_systems`); with ``auto``, ``strategy="auto"`` chooses
first and its pick is judged against the runs (:func:`pipetrain.bench.report.judge_auto`).
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from pipetrain.bench import cluster
from pipetrain.bench.measure import summarize
from pipetrain.bench.pipetrain_jobs import pipetrain_job
from pipetrain.bench.predictions import choose_auto, predict_systems, profile_here
from pipetrain.bench.report import build_report, judge_auto, judge_target
from pipetrain.bench.stages import stage_times
from pipetrain.bench.systems import LOOPED, MICROBATCHED, PIPE_SGD, SuiteConfig, microbatch_counts
from pipetrain.bench.torch_peers import ddp, ps_sync, torch_pipeline
from pipetrain.errors import first_line
from pipetrain.planning import Plan, plan
from pipetrain.planning.schedules import STAGES_PER_WORKER
from pipetrain.profiling import Profile
from pipetrain.setup import Launcher
from pipetrain.runtime.launch import keep_freed_memory, spawn


def run_suite(cfg: SuiteConfig, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run every system of ``cfg`` and return the report (plain data, see :func:`pipetrain.bench.report.format_table`).

    Raises:
        ValueError: no split or microbatch count fits (the message says which).
    """
    keep_freed_memory()  # this process profiles and times stages: as the workers run

    started = time.perf_counter()
    reason = None if cfg.loopback else cluster.unavailable_reason()
    if reason:
        log(f"{reason}; running on loopback")
    job_limit_s = 3 * cfg.timeout_s
    if cfg.loopback or reason:
        report = _run_all(cfg, lambda fn, args, world: spawn(fn, world, args, timeout=job_limit_s), "loopback", log)
        report["note"] = reason
    else:
        with cluster.EmulatedCluster(cfg.hosts, link=cfg.link) as hosts:
            ports = iter(range(29600, 30600))  # a fresh port per job: no waiting on the last job's sockets

            def launch(fn: Callable[..., Any], args: tuple, world: int) -> list[Any]:
                return hosts.spawn(fn, args, world=world, port=next(ports), timeout=job_limit_s)
            # what the link carries (TCP payload, one direction): DDP's rate is bounded by it
            link_bps = cluster.socket_throughput(hosts, 0, 1, seconds=2.0)["bits_per_s"]
            log(f"host 0 -> host 1 socket throughput: {link_bps / 1e6:.0f} Mbit/s")
            report = _run_all(cfg, launch, f"{cfg.hosts} namespaces, {cfg.link}", log, link_bps)
            report["link_payload_bits_per_s"] = link_bps
    report["wall_s"] = time.perf_counter() - started
    return report


def _run_all(cfg: SuiteConfig, launch: Launcher, where: str, log: Callable[[str], None],
             link_bps: float | None = None) -> dict[str, Any]:
    load_at_start = os.getloadavg()[0]
    peer = cfg.peer()
    runs: dict[str, dict[int, dict[str, Any]]] = {}  # system -> microbatches -> summary
    errors: dict[str, str] = {}

    def job(system: str, m: int, fn: Callable[..., Any], args: tuple,
            world: int = cfg.workers) -> dict[str, Any] | None:
        t0, load = time.perf_counter(), os.getloadavg()[0]
        try:
            results = launch(fn, args, world)
        except RuntimeError as e:  # PipetrainError and friends: record, go on with the others
            errors[f"{system} x{m}"] = first_line(e, None)
            log(f"{system} (microbatches {m}): failed: {errors[f'{system} x{m}']}")
            return None
        summary = summarize(results)
        runs.setdefault(system, {})[m] = summary
        log(f"{system}{f' x{m} microbatches' if system in MICROBATCHED else ''}: "
            f"{summary['samples_per_s']:.1f} samples/s ({time.perf_counter() - t0:.0f} s, load before {load:.2f})")
        return summary

    pd_plan, breakdown = None, None
    choice = choose_auto(cfg, peer, launch, link_bps, log) if cfg.auto else None
    if "pipedream" in cfg.systems:
        auto = {"schedule": "pipedream", "stages": cfg.stages} if cfg.stages else \
            {"schedule": "pipedream", "stages": "auto", "bandwidth": cfg.link}
        if choice is not None and "pipeline" in choice.options:
            auto = {"schedule": "pipedream", "stages": choice.options["pipeline"]["stages"]}
        s = job("pipedream", 1, pipetrain_job, (peer, "pipedream", auto, True))
        if s:
            pd_plan, breakdown = s["plan"], s.get("breakdown")
    profile = functools.cache(lambda: profile_here(cfg, peer, cfg.batch_size))  # taken once, if a split needs it
    split, source = _choose_split(cfg, pd_plan, profile)
    log(f"split for the other pipelines: {split} ({source})")
    looped_split = _straight_plan(cfg, profile(), STAGES_PER_WORKER).boundaries if any(s in LOOPED for s in cfg.systems) \
        else []
    if looped_split:
        log(f"split for {' and '.join(s for s in LOOPED if s in cfg.systems)}: {looped_split} (the planner's best "
            f"straight pipeline of {STAGES_PER_WORKER * cfg.workers} stages)")
    for system in cfg.systems:
        if system == "pipedream":
            continue
        if system.startswith("ddp"):
            job(system, 1, ddp, (peer, system == "ddp-fp16"))
            continue
        if system == "ps-sync":
            job(system, 1, ps_sync, (peer,), world=cfg.hosts)
            continue
        if system in PIPE_SGD:
            job(system, 1, pipetrain_job, (peer, system, {"strategy": "pipe-sgd", "compression": PIPE_SGD[system]}))
            continue
        if system == "pipe-sgd-k1":
            job(system, 1, pipetrain_job, (peer, system, {"strategy": "pipe-sgd", "staleness": 1}))
            continue
        if system == "cgdp":
            job(system, 1, pipetrain_job, (peer, system, {"strategy": "cgdp", "chunk": "auto"}))
            continue
        on = looped_split if system in LOOPED else split
        for m in microbatch_counts(system, cfg, cfg.workers):
            if system.startswith("torch-"):
                job(system, m, torch_pipeline, (peer, on, m, system.removeprefix("torch-")))
            else:
                job(system, m, pipetrain_job, (peer, system, {"schedule": system, "stages": on, "microbatches": m}))
    pd_split = runs["pipedream"][1]["stages"] if "pipedream" in runs else split
    log(f"measuring each stage of {pd_split} alone ({cfg.threads} thread(s), median of {cfg.bound_repeats})")
    stages = stage_times(peer, pd_split, repeats=cfg.bound_repeats)
    whole = stage_times(peer, [0], repeats=cfg.bound_repeats)[0]
    report = build_report(cfg, runs, split, source, pd_plan, breakdown, stages, where, errors)
    if choice is not None:
        report["auto"] = judge_auto(choice, report["samples_per_s"])
    if link_bps:
        log("predicting the data-parallel systems from a profile of one worker's shard (Pipe-SGD eq. 2-7)")
        report["predictions"] = predict_systems(cfg, peer, runs, whole["update_s"], link_bps, launch)
        errs = [abs(p["error"]) for p in report["predictions"].values()]
        if errs:
            report["targets"]["prediction_error"] = judge_target("prediction_error", max(errs))
    # the reference every speedup is about: one worker training the whole model (step included)
    report["one_worker_samples_per_s"] = cfg.batch_size / (whole["forward_backward_s"] + whole["update_s"])
    report["load_average"] = [load_at_start, os.getloadavg()[0]]  # 1-minute, at start and end: was the machine quiet?
    return report


def _choose_split(cfg: SuiteConfig, pd_plan: dict[str, Any] | None,
                  profile: Callable[[], Profile]) -> tuple[list[int], str]:
    """The split every pipeline but pipedream runs on, and a phrase saying where it came from
    (``profile``: the model profiled here, taken when needed)."""
    if cfg.stages is not None:
        return list(cfg.stages), "given with --stages"
    if pd_plan is not None:
        p = Plan.from_dict(pd_plan)
        if all(r == 1 for r in p.replicas):
            return p.boundaries, f"pipedream's automatic plan, config {p.config}"
        why = f"pipedream's automatic plan replicates stages (config {p.config})"
    else:
        why = "pipedream was not run"
    straight = _straight_plan(cfg, profile())
    return straight.boundaries, f"{why}; the planner's best straight pipeline for the same profile"


def _straight_plan(cfg: SuiteConfig, profile: Profile, per_worker: int = 1) -> Plan:
    """``per_worker`` stages per worker as the best straight pipeline of that many, from ``profile`` (taken
    here with the workers' thread count, on the first minibatch)."""
    return plan(profile, cfg.workers * per_worker, cfg.link, straight=True)
