"""The report of a side-by-side run: plain data from the runs (:func:`build_report`), the targets
it is judged by, ``strategy="auto"``'s pick judged against the runs, and the report as text
(:func:`format_table`)."""
from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from pipetrain.bench.systems import AUTO_SYSTEM, EXTRA_SYSTEMS, MICROBATCHED, PIPE_SGD, SYSTEMS, TWINS, SuiteConfig
from pipetrain.planning.choose import CANDIDATES, Choice

TARGETS = {
    "pipedream_vs_bound": 0.95,        # of the slowest stage's bound
    "pipedream_vs_torch_1f1b": 1.25,   # at torch-1f1b's best microbatch count
    "pipedream_vs_ddp": 3.0,           # samples/s
    "bytes_saved_vs_ddp": 0.90,        # 1 - pipedream's bytes per sample / ddp's
    "pipe_sgd_vs_ddp": 0.95,           # samples/s
    "pipe_sgd_trunc16_vs_ddp": 1.6,
    "pipe_sgd_quant8_vs_ddp": 2.5,
    "pipe_sgd_quant8_bytes_vs_ddp": 0.30,   # at most: quant8's bytes per sample / ddp's
    "pipe_sgd_vs_k1": 1.3,             # K = 2 against K = 1: what the overlap of ring and compute gains
    "prediction_error": 0.15,          # at most: |predicted / measured - 1| of every data-parallel system
    "cgdp_vs_ddp": 1.10,               # vgg-like, 2 workers on one machine (--loopback)
    "1f1b_flush_vs_torch": 1.0,        # each pipetrain schedule against torch's twin (TWINS), best counts
    "gpipe_vs_torch": 1.0,
    "zero_bubble_vs_torch": 1.0,
    "interleaved_1f1b_vs_torch": 1.0,
    "2bw_vs_pipedream": 0.95,          # with at most 2 weight versions per stage
}
"""What pipetrain should reach beside its peers, stated for vgg-like on a 1 Gbit/s link with 2 workers
(``cgdp_vs_ddp``: on one machine). The ones in :data:`AT_MOST` are met at or below their value, the
others at or above."""
AT_MOST = ("pipe_sgd_quant8_bytes_vs_ddp", "prediction_error")
AUTO_WITHIN = 0.10
"""``strategy="auto"``'s pick is right when it measures within this fraction of the fastest system."""


def stage_seconds(stage: dict[str, Any]) -> float:
    """A pipedream stage's seconds per minibatch alone: forward and backward, its update, and the copy
    of its weights it stashes (:func:`pipetrain.bench.stages.stage_times`)."""
    return stage["forward_backward_s"] + stage["update_s"] + stage["weight_copy_s"]


def build_report(cfg: SuiteConfig, runs: dict[str, dict[int, dict[str, Any]]], split: list[int], source: str,
                 pd_plan: dict[str, Any] | None, breakdown: Any, stages: list[dict[str, Any]], where: str,
                 errors: dict[str, str]) -> dict[str, Any]:
    """The report of ``runs`` (system -> microbatches -> :func:`pipetrain.bench.measure.summarize`), each
    system at its best microbatch count, with the slowest stage's bound from ``stages``
    (:func:`pipetrain.bench.stages.stage_times`) and the targets met or missed."""
    best = {s: max(by_m, key=lambda m: by_m[m]["samples_per_s"]) for s, by_m in runs.items()}
    top = {s: runs[s][m] for s, m in best.items()}
    order = [s for s in (*SYSTEMS, *EXTRA_SYSTEMS) if s in top]
    rate = {s: top[s]["samples_per_s"] for s in order}
    bps = {s: _per_worker(s, top[s]["counted_bytes_per_sample"]) for s in order}
    wire = {s: None if None in (w := top[s]["iface_bytes_per_sample"]) else _per_worker(s, w) for s in order}
    # a stage of r replicas takes r minibatches per its time (round robin); per minibatch a pipedream
    # stage runs its forward and backward, an update and a copy of its weights (the version it stashes)
    replicas = top["pipedream"]["replicas"] if "pipedream" in top else [1] * len(stages)
    bound = min(r * cfg.batch_size / stage_seconds(st) for r, st in zip(replicas, stages))
    report: dict[str, Any] = {
        "config": {k: v for k, v in asdict(cfg).items() if k != "systems"}, "where": where, "note": None,
        "samples_per_s": rate, "bytes_per_sample": bps, "iface_bytes_per_sample": wire,
        "bytes_per_sample_per_rank": {s: top[s]["counted_bytes_per_sample"] for s in order},
        "iface_bytes_per_sample_per_rank": {s: top[s]["iface_bytes_per_sample"] for s in order},
        "window_samples_per_s": {s: top[s]["window_samples_per_s"] for s in order},
        "microbatches": {s: best[s] for s in order},
        "sweep": {s: {str(m): runs[s][m]["samples_per_s"] for m in sorted(runs[s])} for s in order if s in MICROBATCHED},
        "speedup_vs_ddp": {s: rate[s] / rate["ddp"] for s in order} if "ddp" in rate else {},
        "split": {"stages": split, "source": source},
        "pipedream": None if "pipedream" not in top else {
            "stages": top["pipedream"]["stages"], "plan": pd_plan,
            "predicted_samples_per_s": top["pipedream"]["predicted_samples_per_s"],
            "seconds_per_minibatch": breakdown},
        "stage_compute": stages, "bound_samples_per_s": bound,
        # pipetrain's pipelines: the most weight versions each worker held at once
        "weight_versions": {s: top[s]["weight_versions"] for s in order if top[s].get("weight_versions")},
        "errors": errors,
    }
    targets: dict[str, Any] = {}
    if "pipedream" in rate:
        targets["pipedream_vs_bound"] = rate["pipedream"] / bound
        if "torch-1f1b" in rate:
            targets["pipedream_vs_torch_1f1b"] = rate["pipedream"] / rate["torch-1f1b"]
        if "ddp" in rate:
            targets["pipedream_vs_ddp"] = rate["pipedream"] / rate["ddp"]
            targets["bytes_saved_vs_ddp"] = 1 - bps["pipedream"] / bps["ddp"]
    for ours, theirs in TWINS.items():
        if ours in rate and theirs in rate:
            targets[f"{ours.replace('-', '_')}_vs_torch"] = rate[ours] / rate[theirs]
    if "2bw" in rate and "pipedream" in rate:
        targets["2bw_vs_pipedream"] = rate["2bw"] / rate["pipedream"]
    for system in PIPE_SGD:
        if system in rate and "ddp" in rate:
            targets[f"{system.replace('-', '_')}_vs_ddp"] = rate[system] / rate["ddp"]
    if "pipe-sgd" in rate and "pipe-sgd-k1" in rate:
        targets["pipe_sgd_vs_k1"] = rate["pipe-sgd"] / rate["pipe-sgd-k1"]
    if "pipe-sgd-quant8" in rate and "ddp" in rate:
        targets["pipe_sgd_quant8_bytes_vs_ddp"] = bps["pipe-sgd-quant8"] / bps["ddp"]
    if "cgdp" in rate and "ddp" in rate:
        targets["cgdp_vs_ddp"] = rate["cgdp"] / rate["ddp"]
    if "cgdp" in top:
        report["cgdp"] = {"chunks": top["cgdp"].get("chunks"), "search": top["cgdp"].get("search")}
    report["targets"] = {k: judge_target(k, v) for k, v in targets.items()}
    return report


def judge_target(name: str, value: float) -> dict[str, Any]:
    """``value`` beside the target ``name`` of :data:`TARGETS`, and whether it is met."""
    goal = TARGETS[name]
    return {"value": value, "target": goal, "at_most": name in AT_MOST,
            "met": value <= goal if name in AT_MOST else value >= goal}


def judge_auto(choice: Choice, rate: dict[str, float]) -> dict[str, Any]:
    """The choice beside the runs: the measured fastest system, and whether the pick is within
    :data:`AUTO_WITHIN` of it; the same among the systems that keep the arithmetic exact (what auto picks
    without ``allow_compression``)."""
    # every candidate whose system ran: the pipeline too when it was priced as data parallelism
    measured = {n: rate[AUTO_SYSTEM.get(n, n)] for n in CANDIDATES if AUTO_SYSTEM.get(n, n) in rate}
    out: dict[str, Any] = {**choice.to_dict(), "measured": measured}
    exact = [n for n, c in CANDIDATES.items() if not c.changes_arithmetic]
    for key, names in (("any", list(choice.predictions)), ("exact", [n for n in choice.predictions if n in exact])):
        pick = max(names, key=lambda n: choice.predictions[n])
        pool = [n for n in measured if key == "any" or n in exact]
        best = max(pool, key=lambda n: measured[n])
        ratio = measured.get(pick, 0.0) / measured[best]
        out[key] = {"pick": pick, "best": best, "pick_vs_best": ratio, "met": ratio >= 1 - AUTO_WITHIN}
    return out


def _per_worker(system: str, per_rank: list[float]) -> float:
    """One figure of bytes per sample for a system: the mean over its ranks, except ``ps-sync``'s,
    which is its server's (the last rank): every byte crosses the server's link, so that one bounds it."""
    return per_rank[-1] if system == "ps-sync" else statistics.mean(per_rank)


def format_table(report: dict[str, Any]) -> str:
    """The report as text: one row per system, then the split, the bound and the targets."""
    cfg = report["config"]
    rate, bps, wire = report["samples_per_s"], report["bytes_per_sample"], report["iface_bytes_per_sample"]
    ref = rate.get("torch-1f1b")
    lines = [f"{cfg['model']}, {cfg['workers']} workers ({report['where']}), batch {cfg['batch_size']}, "
             f"{cfg['threads']} thread(s) per worker; samples/s = median of {cfg['windows']} windows "
             f"of {cfg['steps_per_window']} steps after {cfg['warmup']} warm-up steps",
             f"{'system':<15}{'samples/s':>10}{'x ddp':>8}{'x torch-1f1b':>14}{'bytes/sample/worker':>21}"
             f"{'on the wire':>13}  microbatches (samples/s)"]
    for s, r in rate.items():
        sweep = report["sweep"].get(s)
        mbs = ", ".join(f"{m}: {v:.1f}" for m, v in sweep.items()) if sweep else "1"
        x_ddp = f"{r / rate['ddp']:.2f}" if "ddp" in rate else "-"
        x_ref = f"{r / ref:.2f}" if ref else "-"
        w = "-" if wire[s] is None else f"{wire[s]:,.0f}"
        tail = f"best {report['microbatches'][s]} ({mbs})" if sweep else mbs
        lines.append(f"{s:<15}{r:>10.1f}{x_ddp:>8}{x_ref:>14}{bps[s]:>21,.0f}{w:>13}  {tail}")
    pd = report["pipedream"]
    if pd:
        plan = pd["plan"]
        how = f"automatic plan {_config(plan)}, predicted {pd['predicted_samples_per_s']:.1f} samples/s" \
            if plan else "given stages"
        lines.append(f"pipedream stages {pd['stages']} ({how})")
    lines.append(f"other pipelines' split {report['split']['stages']}: {report['split']['source']}")
    for st in report["stage_compute"]:
        lines.append(f"  stage layers {st['layers'][0]}-{st['layers'][1]} alone: forward+backward "
                     f"{st['forward_backward_s'] * 1e3:.1f} ms, SGD step {st['update_s'] * 1e3:.1f} ms, "
                     f"weight copy {st['weight_copy_s'] * 1e3:.1f} ms")
    lines.append(f"bound set by the slowest stage (batch / its forward+backward, update and weight copy): "
                 f"{report['bound_samples_per_s']:.1f} samples/s")
    versions = report.get("weight_versions", {})
    if versions:
        lines.append("most weight versions held per worker: " + ", ".join(f"{s} {v}" for s, v in versions.items()))
    if "one_worker_samples_per_s" in report:
        lines.append(f"one worker alone, whole model (forward+backward+SGD step): "
                     f"{report['one_worker_samples_per_s']:.1f} samples/s")
    link = report.get("link_payload_bits_per_s")
    if link and "ddp" in rate:
        lines.append(f"link: {link / 1e6:.0f} Mbit/s TCP payload measured host 0 -> 1; at that rate DDP's "
                     f"{bps['ddp']:,.0f} bytes/sample/worker allow at most {link / 8 / bps['ddp']:.1f} samples/s")
    if "ps-sync" in rate:
        per_rank = report["bytes_per_sample_per_rank"]["ps-sync"]
        # the server sends the weights only after every gradient has arrived: in, then out, at the link rate
        bound = f"; receiving then sending them at that link rate allows at most " \
                f"{link / 8 / (2 * bps['ps-sync']):.1f} samples/s" if link else ""
        lines.append(f"ps-sync: {len(per_rank) - 1} workers and a parameter server (rank {len(per_rank) - 1}, its "
                     f"own host); its bytes/sample are the server's, the busiest link (the weights to every worker, "
                     f"after as many gradient bytes in); each worker sends {statistics.mean(per_rank[:-1]):,.0f}"
                     f"{bound}")
    if "load_average" in report:
        lines.append(f"load average (1 min) at start and end: {report['load_average'][0]:.2f}, "
                     f"{report['load_average'][1]:.2f}; wall time {report['wall_s']:.0f} s")
    if pd and pd["seconds_per_minibatch"]:
        for r, kinds in enumerate(pd["seconds_per_minibatch"]):
            parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
            lines.append(f"  pipedream rank {r}, ms per minibatch in the windows: {parts}")
    if report.get("cgdp") and report["cgdp"]["search"]:
        search, chunks = report["cgdp"]["search"], report["cgdp"]["chunks"]
        tried = ", ".join(f"{k}: {lapse:.2f} s" for k, lapse in search["trials"])
        lines.append(f"cgdp: the chunk search {'chose' if search['done'] else 'was still trying'} chunk {search['best']}"
                     f" (seconds of {search['interval']} iterations per chunk size tried: {tried}); the timed "
                     f"windows ran at chunk {chunks[-1]}")
    for system, pr in report.get("predictions", {}).items():
        ring = f", measured ring {pr['measured_ring_s'] * 1e3:.0f} ms" if pr["measured_ring_s"] else ""
        cpu = "" if pr["comm_cpu_s"] is None else f" (of which allreduce CPU {pr['comm_cpu_s'] * 1e3:.0f} ms)"
        lines.append(f"  {system}: predicted {pr['predicted_samples_per_s']:.1f} samples/s, measured "
                     f"{pr['measured_samples_per_s']:.1f} ({pr['error']:+.1%}); model: compute "
                     f"{pr['compute_s'] * 1e3:.0f} ms + update {pr['update_s'] * 1e3:.0f} ms{cpu}, allreduce "
                     f"{pr['comm_s'] * 1e3:.0f} ms{ring}; {pr['bound']} bound, SE {pr['scaling_efficiency']:.2f}")
    if "auto" in report:
        auto = report["auto"]
        lines.append("strategy auto (predicted from a profile and set-up taken before the runs; measured):")
        for name, rate in sorted(auto["predictions"].items(), key=lambda kv: -kv[1]):
            got = auto["measured"].get(name)
            lines.append(f"  {name:<18}{rate:>10.1f}{'-' if got is None else f'{got:.1f}':>10}"
                         f"{f' ({rate / got - 1:+.0%})' if got else ''}")
        for key, what in (("any", "codecs allowed"), ("exact", "exact arithmetic")):
            j = auto[key]
            lines.append(f"  {what}: picks {j['pick']}, measured fastest {j['best']}: {j['pick_vs_best']:.2f} of it "
                         f"({'met' if j['met'] else 'MISSED'}: within {AUTO_WITHIN:.0%})")
    for k, t in report["targets"].items():
        lines.append(f"target {k}: {t['value']:.3f} ({'<=' if t['at_most'] else '>='} {t['target']}) "
                     f"{'met' if t['met'] else 'MISSED'}")
    for k, e in report["errors"].items():
        lines.append(f"failed: {k}: {e}")
    return "\n".join(lines)


def _config(plan: dict[str, Any]) -> str:
    return "-".join(str(s["replicas"]) for s in plan["stages"])
