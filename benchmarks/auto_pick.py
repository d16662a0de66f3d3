"""Does ``strategy="auto"`` pick the fastest strategy?

    flock /tmp/pipetrain-bench.lock python benchmarks/auto_pick.py [--cases NAME,...] [--json F]

For each case (a zoo model, its workers and batch, at 100 Mbit/s and at 1 Gbit/s), ``pipetrain bench
--auto`` on the emulated cluster: before any run, pipetrain profiles the model here and measures the
run set-up on the same hosts, prices every candidate ``strategy="auto"`` weighs (the best PipeDream
plan, ddp, pipe-sgd with each codec; CGDP needs one machine, and each emulated host is one) at the link's
measured rate, and picks; then every candidate is run and timed (``pipedream`` on the plan that was
priced). A case is met when the pick measures at least 90% of the fastest, once with codecs allowed
(``allow_compression=True``: every strategy) and once among the strategies that keep the arithmetic
exact (the pick without it). Each case also reports the TCP payload the emulated link carried (host 0
to 1, measured before the runs) against the link's rate.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipetrain.bench.cluster import link_bits_per_s
from pipetrain.bench.suite import run_suite
from pipetrain.bench.systems import QUICK, SuiteConfig

SYSTEMS = ("pipedream", "ddp", "pipe-sgd", "pipe-sgd-trunc16", "pipe-sgd-quant8")
MODELS: dict[str, dict[str, Any]] = {
    "vgg-like": dict(workers=2, batch_size=32),
    "mnist-mlp": dict(workers=4, batch_size=100),
    "resnet-like": dict(workers=2, batch_size=32),
    "lstm-lm": dict(workers=2, batch_size=32),
}
"""Each model with the workers and batch its other benchmarks use (mnist-mlp: the Pipe-SGD paper's)."""
LINKS = ("100mbit", "1gbit")
CASES = {f"{model}@{link}": (model, link) for model in MODELS for link in LINKS}
LINK_PAYLOAD_GOAL = 0.8
"""The emulated link carries at least this share of its rate as TCP payload (at most 1448 of each
1514-byte frame: 0.957)."""


def run_case(name: str, log: Any) -> dict[str, Any]:
    """One case's ``pipetrain bench --auto --quick`` report."""
    model, link = CASES[name]
    cfg = SuiteConfig(model=model, link=link, systems=SYSTEMS, auto=True, **MODELS[model], **QUICK)
    return run_suite(cfg, log=lambda line: log(f"{name}: {line}"))


def markdown(reports: dict[str, dict[str, Any]]) -> str:
    """The table: per case, predicted / measured samples/s of every strategy, the picks and the fastest."""
    names = ("pipeline", "ddp", "pipe-sgd", "pipe-sgd-trunc16", "pipe-sgd-quant8")
    head = "| case | " + " | ".join(names) + " | pick (codecs allowed) | fastest | pick / fastest | " \
           "pick (exact) | fastest exact | pick / fastest |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for case, rep in reports.items():
        auto = rep["auto"]
        cells = []
        for n in names:
            pred, got = auto["predictions"].get(n), auto["measured"].get(n)
            cells.append(("-" if pred is None else f"{pred:.0f}") + " / " + ("-" if got is None else f"{got:.0f}"))
        a, e = auto["any"], auto["exact"]
        rows.append(f"| {case} | " + " | ".join(cells) +
                    f" | {a['pick']} | {a['best']} | {a['pick_vs_best']:.2f}{'' if a['met'] else ' (missed)'} |"
                    f" {e['pick']} | {e['best']} | {e['pick_vs_best']:.2f}{'' if e['met'] else ' (missed)'} |")
    met = sum(r["auto"]["any"]["met"] for r in reports.values())
    exact = sum(r["auto"]["exact"]["met"] for r in reports.values())
    rows.append(f"\nmet (within 10% of the fastest): {met} of {len(reports)} with codecs allowed, "
                f"{exact} of {len(reports)} among exact strategies")
    links = [line for case, rep in reports.items() if (line := link_payload(case, rep))]
    if links:
        rows.append(f"\nlink payload (TCP, host 0 -> 1) against the link's rate, goal at least {LINK_PAYLOAD_GOAL}:")
        rows.extend(links)
    return "\n".join(rows)


def link_payload(case: str, report: dict[str, Any]) -> str | None:
    """One case's measured link payload over its link's rate and whether it meets :data:`LINK_PAYLOAD_GOAL`
    (None where the suite ran on loopback: no emulated link)."""
    measured = report.get("link_payload_bits_per_s")
    if measured is None:
        return None
    rate = link_bits_per_s(CASES[case][1])
    share = measured / rate
    return f"- {case}: {measured / 1e6:.1f} of {rate / 1e6:.0f} Mbit/s, {share:.3f}: " \
           f"{'met' if share >= LINK_PAYLOAD_GOAL else 'missed'}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--json", default=None, help="write every case's report here")
    args = p.parse_args(argv)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")

    def log(line: str) -> None:
        print(f"auto_pick: {line}", file=sys.stderr, flush=True)

    reports = {}
    for case in chosen:
        reports[case] = run_case(case, log)
        log(f"{case}: {json.dumps({k: reports[case]['auto'][k] for k in ('any', 'exact')})}")
        if args.json:  # after every case: a long run keeps what it measured
            with open(args.json, "w") as f:
                json.dump(reports, f)
    print(markdown(reports))


if __name__ == "__main__":
    main()
