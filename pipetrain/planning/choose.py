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

from pipetrain.planning.result import Plan
from pipetrain.planning.units import format_bandwidth, parse_bandwidth
from pipetrain.profiling import Profile
from pipetrain.simulate import Link
from pipetrain.strategies.kinds import CGDP, DDP, Pipeline, PipeSGD, Strategy

CANDIDATES: dict[str, Strategy] = {
    "pipeline": Pipeline(), "ddp": DDP(), "pipe-sgd": PipeSGD(staleness=2),
    "pipe-sgd-trunc16": PipeSGD(staleness=2, compression="trunc16"),
    "pipe-sgd-quant8": PipeSGD(staleness=2, compression="quant8"), "cgdp": CGDP(),
}
"""Every candidate ``choose_strategy`` predicts, by the name its table shows."""


@dataclass
class Choice:
    """What ``choose_strategy`` found.

    Attributes:
        choice: the fastest allowed candidate (a key of :data:`CANDIDATES`).
        predictions: samples/s per candidate that could run.
        options: per candidate, its strategy and options by name (:meth:`pipetrain.registry.from_options`
            reads them back), the pipeline's plan under ``stages``, CGDP's chunk under ``chunk``.
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
            rows.append(f"{name:<18} {rate:>10.1f}{mark}{_how(self.options[name])}"
                        + (f" ({self.skipped[name]})" if name in self.skipped else ""))
        rows += [f"{name:<18} {'-':>10}    {why}" for name, why in self.skipped.items() if name not in self.predictions]
        return "\n".join(rows)


def _how(options: dict[str, Any]) -> str:
    if "stages" in options:
        chosen = options["stages"]
        fewer = chosen.options.get("fewer_workers_faster")
        asked = chosen.options.get("asked_workers", chosen.workers)
        used = f" on {chosen.workers} of the {asked} workers" if chosen.workers < asked else ""
        return f"plan {chosen.config}{used}, NOAM {chosen.noam}" + (
            f"; one for {fewer['workers']} workers ({fewer['config']}) simulates faster" if fewer else "")
    return ", ".join(f"{k} {v}" for k, v in options.items() if k != "strategy") or "synchronous"


def choose_strategy(profile: Profile, workers: int, bandwidth: float | str | None = None, *,
                    batch_size: int | None = None, one_machine: bool | None = None, allow_compression: bool = False,
                    strategies: Sequence[str] | None = None, host_costs: dict[str, float] | None = None,
                    minibatches: int | None = None, every_worker: bool = False) -> Choice:
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
        allow_compression: let a codec that changes the arithmetic be picked; it is still predicted.
        strategies: the candidates to predict.
        host_costs: CGDP's ``copy_s_per_byte`` and ``sum_s_per_byte`` (default: measured here,
            :func:`pipetrain.strategies.cgdp.measure_host_costs`).
        minibatches: simulated per candidate (default: each prediction's own).
        every_worker: the pipeline runs a plan for all ``workers`` (a job keeps the workers it was
            started on), its plan's ``options["fewer_workers_faster"]`` naming a faster one for fewer;
            else it may take fewer where more cannot help, as ``pipetrain plan`` does.

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
        candidate = Pipeline(every_worker=True) if name == "pipeline" and every_worker else CANDIDATES[name]
        why = candidate.cannot_run(workers, batch, one_machine)
        if why:
            skipped[name] = why
            continue
        priced = candidate.predict(profile, workers, link, batch, minibatches=minibatches, host=host_costs)
        if priced.skip:
            skipped[name] = priced.skip
            continue
        predictions[name], options[name] = priced.samples_per_s, priced.options()
        if candidate.changes_arithmetic and not allow_compression:
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
