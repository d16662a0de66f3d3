"""``strategy="auto"``: predict every strategy's samples/s from one profile and pick the fastest.

Each candidate is priced by the model of its own paper, all run through the one simulator: the best
PipeDream plan (§3.2) run by the ``pipedream`` schedule, DDP as synchronous SGD (Pipe-SGD eq. 2),
Pipe-SGD with K = 2 and each codec (eq. 4-5), and, on one machine, CGDP at its best chunk (eq. 1-2).
A pipeline plan that puts the whole model on every worker is data parallelism: it competes as such
(``ddp``), not as a pipeline. The profile's measured set-up (:class:`pipetrain.setup.Setup`), when it
has one, prices what the workers of this machine cost each other.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipetrain.costs import ring_allreduce_time
from pipetrain.planning.partition import plan
from pipetrain.planning.result import Plan
from pipetrain.planning.units import format_bandwidth, parse_bandwidth
from pipetrain.profiling import Profile
from pipetrain.registry import build_schedule
from pipetrain.simulate import Link, predict_cgdp, predict_data_parallel, simulate
from pipetrain.strategies import cgdp
from pipetrain.timing import torch_threads

CANDIDATES: dict[str, dict[str, Any]] = {
    "pipeline": {"strategy": "pipeline", "schedule": "pipedream"},
    "ddp": {"strategy": "ddp"},
    "pipe-sgd": {"strategy": "pipe-sgd", "staleness": 2},
    "pipe-sgd-trunc16": {"strategy": "pipe-sgd", "staleness": 2, "compression": "trunc16"},
    "pipe-sgd-quant8": {"strategy": "pipe-sgd", "staleness": 2, "compression": "quant8"},
    "cgdp": {"strategy": "cgdp"},
}
"""Every name ``choose_strategy`` predicts, and the ``pipetrain.train`` arguments that run it."""

COMPRESSED = ("pipe-sgd-trunc16", "pipe-sgd-quant8")
"""Candidates whose codec changes the arithmetic: picked only with ``allow_compression``."""


@dataclass
class Choice:
    """What ``choose_strategy`` found.

    Attributes:
        choice: the fastest allowed candidate (a key of :data:`CANDIDATES`).
        predictions: samples/s per candidate that could run.
        options: per candidate, the ``pipetrain.train`` arguments that run it (the pipeline's plan
            under ``stages``, CGDP's chunk under ``chunk``).
        skipped: per candidate that is not predicted or not allowed, why.
        reason: one line saying why ``choice`` won.
    """

    choice: str
    predictions: dict[str, float]
    options: dict[str, dict[str, Any]]
    skipped: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"choice", "predictions", "options", "skipped", "reason"}`` (plans as dicts)."""
        plain = {name: {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in opts.items()}
                 for name, opts in self.options.items()}
        return {"choice": self.choice, "predictions": self.predictions, "options": plain, "skipped": self.skipped,
                "reason": self.reason}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Choice:
        """The choice :meth:`to_dict` gave (plans as Plans again)."""
        options = {name: {**opts, "stages": Plan.from_dict(opts["stages"])} if "stages" in opts else dict(opts)
                   for name, opts in data["options"].items()}
        return Choice(data["choice"], dict(data["predictions"]), options, dict(data["skipped"]), data["reason"])

    def table(self) -> str:
        """The predictions as a small table, fastest first, the choice marked."""
        rows = [f"{'strategy':<18} {'samples/s':>10}  how"]
        for name, rate in sorted(self.predictions.items(), key=lambda kv: -kv[1]):
            mark = " <- " if name == self.choice else "    "
            rows.append(f"{name:<18} {rate:>10.1f}{mark}{_how(name, self.options[name])}"
                        + (f" ({self.skipped[name]})" if name in self.skipped else ""))
        rows += [f"{name:<18} {'-':>10}    {why}" for name, why in self.skipped.items() if name not in self.predictions]
        return "\n".join(rows)


def _how(name: str, options: dict[str, Any]) -> str:
    if name == "pipeline":
        stages = options["stages"]
        return f"plan {stages.config}, NOAM {stages.noam}"
    if name == "cgdp":
        return f"chunk {options['chunk']}"
    return ", ".join(f"{k} {v}" for k, v in options.items() if k != "strategy") or "synchronous"


def choose_strategy(profile: Profile, workers: int, bandwidth: float | str | None = None, *,
                    batch_size: int | None = None, one_machine: bool | None = None, allow_compression: bool = False,
                    strategies: Sequence[str] | None = None, host_costs: dict[str, float] | None = None,
                    minibatches: int = 32) -> Choice:
    """Predict samples/s of every strategy in ``strategies`` (default all of :data:`CANDIDATES`) and pick
    the fastest.

    Args:
        profile: per-layer costs (with the run set-up, if measured).
        workers: the workers to use.
        bandwidth: each worker's link (bytes/s or e.g. ``"1Gbit"``); None: unlimited beyond the measured
            transport of the profile's set-up (workers of one machine).
        batch_size: samples per minibatch of the whole job (default: the profile's).
        one_machine: whether all workers share one machine (CGDP competes only then); default: when no
            ``bandwidth`` is given.
        allow_compression: let a codec that changes the arithmetic (:data:`COMPRESSED`) be picked; it is
            still predicted.
        strategies: the candidates to predict.
        host_costs: CGDP's ``copy_s_per_byte`` and ``sum_s_per_byte`` (default: measured here,
            :func:`pipetrain.strategies.cgdp.measure_host_costs`).
        minibatches: simulated per candidate.

    Raises:
        ValueError: an unknown candidate, workers < 1, or no candidate that can run.
    """
    names = list(CANDIDATES) if strategies is None else list(strategies)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(CANDIDATES)} (or 'all')")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: give the workers to choose for, at least 1")
    batch = profile.batch_size if batch_size is None else batch_size
    if batch < 1:
        raise ValueError("the profile does not record its batch size; give batch_size")
    bps = math.inf if bandwidth is None else parse_bandwidth(bandwidth)
    one_machine = bandwidth is None if one_machine is None else one_machine
    link = Link(bps)
    predictions: dict[str, float] = {}
    options: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        opts = dict(CANDIDATES[name])
        why = _cannot(name, workers, batch, one_machine)
        if why:
            skipped[name] = why
            continue
        if name == "pipeline":
            chosen = plan(profile, workers, bps if bps < math.inf else 1e15)
            if len(chosen.stages) == 1:
                skipped[name] = "the best plan is one stage on every worker: data parallelism, priced as ddp"
                continue
            rate = predict_plan(profile, chosen, link, batch, minibatches=minibatches)
            opts["stages"] = chosen
        elif name == "cgdp":
            rate, opts["chunk"] = _best_chunk(profile, workers, batch, host_costs)
        else:
            rate = predict_data_parallel(profile, opts["strategy"], workers, link, batch,
                                         staleness=opts.get("staleness"), compression=opts.get("compression"),
                                         minibatches=minibatches).samples_per_s
        predictions[name], options[name] = rate, opts
        if name in COMPRESSED and not allow_compression:
            skipped[name] = "changes the arithmetic: allow_compression=True (--allow-compression) to pick it"
    allowed = {n: r for n, r in predictions.items() if n not in skipped}
    if not allowed:
        raise ValueError(f"no strategy can run {workers} workers here: " +
                         "; ".join(f"{n}: {w}" for n, w in skipped.items()))
    best = max(allowed, key=lambda n: allowed[n])
    runner_up = max((n for n in allowed if n != best), key=lambda n: allowed[n], default=None)
    where = f"{workers} workers" + (f" at {format_bandwidth(bps)}" if bps < math.inf else " on this machine")
    reason = f"{best} is predicted fastest for {where}: {allowed[best]:.0f} samples/s"
    if runner_up is not None:
        reason += f", {allowed[best] / allowed[runner_up]:.2f}x {runner_up}'s {allowed[runner_up]:.0f}"
    faster = [n for n in predictions if n not in allowed and predictions[n] > allowed[best]]
    if faster:
        reason += f" ({faster[0]} would be {predictions[faster[0]] / allowed[best]:.2f}x, with compression allowed)"
    return Choice(best, predictions, options, skipped, reason)


def predict_plan(profile: Profile, chosen: Plan, link: Link, batch_size: int, schedule: str = "pipedream",
                 minibatches: int = 32, microbatches: int = 1, epoch: bool = False) -> float:
    """Samples/s of ``chosen`` run by ``schedule`` (with ``microbatches`` per minibatch) over ``link``,
    simulated for about ``minibatches`` (rounded up so every replica joins every sync): the steady rate,
    or with ``epoch`` the rate of an epoch of them as it runs, the pipeline filled at its start and
    drained at its end (samples over the simulated makespan; the runtime runs each epoch so)."""
    every = math.lcm(*chosen.replicas)
    count = -(-minibatches // every) * every
    sim = simulate(build_schedule(schedule, chosen.replicas, count, microbatches), profile, chosen.boundaries,
                   link, batch_size)
    if epoch:
        return count * batch_size / sim.makespan_s if sim.makespan_s > 0 else 0.0
    return sim.samples_per_s or 0.0


def _cannot(name: str, workers: int, batch: int, one_machine: bool) -> str:
    """Why candidate ``name`` cannot run (empty if it can)."""
    if name == "pipeline":
        return "" if workers > 1 else "one worker has nothing to pipeline"
    if batch % workers:
        return f"batch {batch} does not split into {workers} equal shards"
    if name == "cgdp" and not one_machine:
        return "CGDP sums in one machine's memory; the workers span machines"
    return ""


def _best_chunk(profile: Profile, workers: int, batch: int, host: dict[str, float] | None) -> tuple[float, int]:
    """CGDP's (samples/s, layers per chunk) at the chunk size its cost model predicts fastest (of
    several alike, the one with the fewest chunks)."""
    units = sum(1 for x in profile.layers if x.parameter_bytes)
    if host is None:  # timed as the workers add, with their thread count
        with torch_threads(None if profile.setup is None else profile.setup.threads):
            host = cgdp.measure_host_costs(min(profile.parameter_bytes // 4, 1 << 24), workers)
    # a signal is a 1-element allreduce among the machine's workers: 2 (L - 1) messages
    signal = 0.0 if profile.setup is None else float(ring_allreduce_time(
        workers, 4.0, *profile.setup.allreduce_terms(ours=False), 0.0))
    found = {k: predict_cgdp(profile, workers, k, batch, signal_s=signal, copy_s_per_byte=host["copy_s_per_byte"],
                             sum_s_per_byte=host["sum_s_per_byte"]) for k in range(1, max(units, 1) + 1)}
    rates = {k: p.samples_per_s for k, p in found.items()}
    # Of the sizes the model prices alike, the fewest chunks: every chunk costs the backward more than the
    # model prices (only its signals' CPU, and nothing with a core per worker).
    best = max(rates.values())
    chunk = min((k for k in rates if rates[k] >= best * (1 - 1e-9)), key=lambda k: (len(found[k].chunks), k))
    return rates[chunk], chunk
