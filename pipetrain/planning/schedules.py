"""``schedule="auto"``: price every pipeline schedule in the simulator and pick the fastest that fits.

For each schedule of the registry, at each microbatch count that splits the minibatch, the
partitioner's plan for the workers (a straight one for schedules that cannot replicate a stage) runs
through the simulator: its epoch rate as the runtime measures it, and each worker's memory from the
same simulated timeline (the weight versions and the activations it held at most). A row over the
memory limit is priced again with activation recomputation, where a stage keeps only its inputs and
runs each forward twice; a row still over it is left out. The fastest row left is the choice.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pipetrain.costs import allreduce_copy_bytes, worker_memory_bytes
from pipetrain.layout import Layout
from pipetrain.planning import Plan, plan
from pipetrain.planning.units import format_bytes, parse_bandwidth, parse_bytes
from pipetrain.predict.pipeline import best_plan, epoch_rate, propose, simulate_plan
from pipetrain.profiling import Profile
from pipetrain.registry import SCHEDULES, PipelineSchedule
from pipetrain.simresult import SimResult
from pipetrain.simulate import Link
from pipetrain.stagecost import stage_costs

MICROBATCHES = (1, 2, 4, 8)
"""The microbatch counts tried for a schedule that splits minibatches (those that divide the batch)."""

NEVER_PICKED = {"naive": "the ablation: its backward runs on other weights than its forward"}
"""Schedules the table shows but never picks, and why."""


@dataclass
class ScheduleRow:
    """One schedule at one microbatch count: its plan, predicted samples/s and memory, or why it is out.

    Attributes:
        schedule: the schedule's name; ``microbatches`` its microbatches per minibatch.
        recompute: priced with activation recomputation (the row did not fit without it).
        config: the plan's stages and replicas (``Plan.config``), "" when there is none.
        samples_per_s: the simulated epoch rate; None when not priced.
        memory_bytes: the most any worker holds (weights, stashed versions, activations).
        why: empty for a row that can run and fits; else why it is left out.
    """

    schedule: str
    microbatches: int
    recompute: bool = False
    config: str = ""
    samples_per_s: float | None = None
    memory_bytes: float = 0.0
    why: str = ""

    @property
    def label(self) -> str:
        return self.schedule + (f" m={self.microbatches}" if self.microbatches > 1 else "") + \
            (" +recompute" if self.recompute else "")


@dataclass
class ScheduleChoice:
    """Every row priced, the fastest that fits (``best``, an index into ``rows``), its plan, and why."""

    rows: list[ScheduleRow]
    best: int
    plan: Plan
    reason: str

    @property
    def chosen(self) -> ScheduleRow:
        return self.rows[self.best]

    def schedule(self) -> PipelineSchedule:
        """The chosen schedule as an object with its options."""
        return _make(self.chosen.schedule, self.chosen.microbatches)

    def table(self) -> str:
        """The rows, fastest first, the choice marked, the rows left out last with their reason."""
        head = f"{'schedule':<30} {'samples/s':>10} {'memory':>10}  plan"
        priced = sorted((r for r in self.rows if r.samples_per_s is not None), key=lambda r: -(r.samples_per_s or 0))
        lines = [head]
        for r in priced:
            mark = " <- " if r is self.chosen else "    "
            out = f" ({r.why})" if r.why else ""
            lines.append(f"{r.label:<30} {r.samples_per_s:>10.1f} {format_bytes(r.memory_bytes):>10}{mark}{r.config}{out}")
        lines += [f"{r.label:<30} {'-':>10} {'-':>10}    {r.why}" for r in self.rows if r.samples_per_s is None]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows], "best": self.best, "plan": self.plan.to_dict(),
                "reason": self.reason}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ScheduleChoice:
        return ScheduleChoice([ScheduleRow(**r) for r in data["rows"]], data["best"], Plan.from_dict(data["plan"]),
                              data["reason"])


def _make(name: str, microbatches: int) -> PipelineSchedule:
    cls: Any = SCHEDULES[name]  # a schedule that splits minibatches takes microbatches=
    return cls(microbatches=microbatches) if microbatches > 1 else cls()


def microbatch_counts(name: str, batch_size: int, candidates: Sequence[int] = MICROBATCHES) -> list[int]:
    """The microbatch counts ``name`` is priced at: 1 for a schedule that does not split minibatches,
    else each candidate that divides the batch."""
    if "microbatches" not in {f.name for f in fields(SCHEDULES[name])}:
        return [1]
    return [m for m in candidates if m <= batch_size and batch_size % m == 0]


def recomputed(profile: Profile) -> Profile:
    """``profile`` as a stage that recomputes prices it: every backward runs its layer's forward first."""
    return replace(profile, layers=[replace(x, backward_s=x.backward_s + x.forward_s) for x in profile.layers])


def worker_memory(profile: Profile, chosen: Plan, schedule: PipelineSchedule, sim: SimResult, batch_size: int,
                  recompute: bool) -> list[float]:
    """Bytes each worker holds at most in ``sim``: its stages' weights, one copy per stashed version
    (schedules that stash), and the activations of its microbatches in flight; with ``recompute`` only
    their inputs, plus one microbatch's activations while it is recomputed. A worker holding several
    stages is priced at the largest of them per microbatch in flight. To those come its gradients, its
    optimizer's state, a replicated stage's allreduce copies and the profile's process baseline, as
    :func:`pipetrain.costs.worker_memory_bytes` counts them; where the memory prediction of a job
    (:mod:`pipetrain.predict.memory`) counts the schedule's in-flight (micro)batches and versions, this
    reads them off the simulated run."""
    m = schedule.microbatches
    per_stage = stage_costs(profile, chosen.boundaries, batch_size)
    inputs = [s.input_bytes for s in per_stage]
    layout = Layout(tuple(chosen.replicas))
    looped = len(sim.peak_activation_bytes)
    held_by = [list(range(w, len(per_stage), looped)) for w in range(looped)] if schedule.looped else \
        [[s] for s, r in enumerate(chosen.replicas) for _ in range(r)]
    out = []
    for w, stages in enumerate(held_by):
        weights = sum(per_stage[s].parameter_bytes *
                      (1 + (sim.peak_weight_versions[w] if schedule.policy(layout, s) in COPIES else 0))
                      for s in stages)
        held = sim.peak_activation_bytes[w]
        stash = max(per_stage[s].stash_bytes for s in stages) / m
        if recompute and stash > 0:
            held = held / stash * max(inputs[s] for s in stages) / m + stash
        grads = sum(per_stage[s].gradient_bytes for s in stages)
        sync = sum(allreduce_copy_bytes(per_stage[s].gradient_bytes, chosen.replicas[s]) for s in stages)
        out.append(float(worker_memory_bytes(weights + held, grads, sum(per_stage[s].optimizer_bytes for s in stages),
                                             sync, profile.baseline_bytes)))
    return out


COPIES = ("stash", "vertical", "double")
"""The weight policies that keep copies of versions beside the live weights, one per version held."""

STAGES_PER_WORKER = 2
"""How many stages each worker holds when a looped schedule (``interleaved-1f1b``) is priced."""


def choose_schedule(profile: Profile, workers: int, bandwidth: float | str, batch_size: int | None = None, *,
                    memory: float | str | None = None, link: Link | None = None, minibatches: int = 16,
                    schedules: Sequence[str] | None = None, microbatches: Sequence[int] = MICROBATCHES,
                    recompute: bool | None = None, fewer_workers: bool = True) -> ScheduleChoice:
    """Price every schedule in ``schedules`` (default all) for ``workers`` and pick the fastest that fits.

    Args:
        profile: per-layer costs; bandwidth: between workers, what the partitioner plans for.
        batch_size: samples per minibatch (default the profile's).
        memory: bytes per worker (or e.g. ``"16GiB"``) every worker must fit in; None: no limit.
        link: the simulated link (default ``bandwidth``'s).
        minibatches: simulated per row, an epoch of them filled and drained.
        microbatches: the counts tried for schedules that split minibatches.
        recompute: price every row with activation recomputation (True), none (False), or a row only when
            it does not fit without (None).
        fewer_workers: the schedules that replicate stages may run a plan for fewer workers where the
            simulator finds it faster (:func:`~pipetrain.predict.pipeline.best_plan`); False where every
            worker must take part (torchrun started them all).

    Raises:
        ValueError: an unknown schedule, or no row that can run and fit (the message lists why each failed).
    """
    names = list(SCHEDULES) if schedules is None else list(schedules)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; choose from {', '.join(SCHEDULES)} (or 'all')")
    batch = profile.batch_size if batch_size is None else batch_size
    if batch < 1:
        raise ValueError("the profile does not record its batch size; give batch_size")
    limit = None if memory is None else parse_bytes(memory, "memory")
    link = Link(parse_bandwidth(bandwidth)) if link is None else link
    plans: dict[tuple[bool, int], Plan | str] = {}
    rows: list[ScheduleRow] = []
    for name in names:
        key = _plan_key(name)
        if key not in plans:
            try:  # a looped schedule: a straight plan of its stages, as if each had a worker
                plans[key] = plan(profile, workers * key[1], bandwidth, straight=key[0]) if key[0] else \
                    _replicated(profile, workers, bandwidth, link, batch, fewer_workers)
            except ValueError as e:
                plans[key] = str(e)
        for m in microbatch_counts(name, batch, microbatches):
            rows.append(_row(profile, name, m, plans[key], workers, link, batch, minibatches, limit, recompute))
    fits = [i for i, r in enumerate(rows) if r.samples_per_s is not None and not r.why]
    if not fits:
        raise ValueError("no schedule can run here: " + "; ".join(f"{r.label}: {r.why}" for r in rows))
    best = max(fits, key=lambda i: rows[i].samples_per_s or 0.0)
    chosen = plans[_plan_key(rows[best].schedule)]
    assert isinstance(chosen, Plan)
    return ScheduleChoice(rows, best, chosen, _reason(rows, best, limit))


def _replicated(profile: Profile, workers: int, bandwidth: float | str, link: Link, batch: int,
                fewer_workers: bool) -> Plan:
    """The plan the schedules that replicate stages run: the one ``pipetrain plan`` prints, the
    simulator's pick among the partitioner's plans (and, with ``fewer_workers``, its plans for fewer)."""
    return best_plan(profile, propose(profile, workers, bandwidth), link, batch, every_worker=not fewer_workers)


def _plan_key(name: str) -> tuple[bool, int]:
    """Which plan ``name`` runs: (straight, stages per worker)."""
    cls = SCHEDULES[name]
    return (not cls.replicable, STAGES_PER_WORKER if cls.looped else 1)


def _row(profile: Profile, name: str, m: int, chosen: Plan | str, workers: int, link: Link, batch: int,
         minibatches: int, limit: float | None, recompute: bool | None) -> ScheduleRow:
    """One row: priced as is, then with recomputation if it does not fit ``limit`` (``recompute`` None),
    or only as ``recompute`` says."""
    if isinstance(chosen, str):
        return ScheduleRow(name, m, why=chosen)
    try:
        schedule = _make(name, m).placed(workers)
        schedule.check_layout(Layout(tuple(chosen.replicas)))
    except ValueError as e:
        return ScheduleRow(name, m, config=chosen.config, why=str(e))
    row = ScheduleRow(name, m, config=chosen.config)
    for again in (False, True) if recompute is None else (recompute,):
        priced = recomputed(profile) if again else profile
        sim, count = simulate_plan(priced, chosen, link, batch, schedule, max(minibatches, m))
        row = ScheduleRow(name, m, again, chosen.config, epoch_rate(sim, count, batch),
                          max(worker_memory(profile, chosen, schedule, sim, batch, again)))
        if limit is None or row.memory_bytes <= limit:
            break
        row.why = f"needs {format_bytes(row.memory_bytes)} on a worker, over the limit {format_bytes(limit)}"
    if not row.why and name in NEVER_PICKED:
        row.why = NEVER_PICKED[name]
    return row


def _reason(rows: list[ScheduleRow], best: int, limit: float | None) -> str:
    """One line: why the chosen row won, against the fastest other row that fits, and the fastest left out."""
    b = rows[best]
    assert b.samples_per_s is not None
    line = f"{b.label} is predicted fastest: {b.samples_per_s:.0f} samples/s"
    others = [r for i, r in enumerate(rows) if i != best and r.samples_per_s is not None and not r.why]
    if others:
        runner = max(others, key=lambda r: r.samples_per_s or 0.0)
        line += f", {b.samples_per_s / (runner.samples_per_s or math.inf):.2f}x {runner.label}'s {runner.samples_per_s:.0f}"
    faster = [r for r in rows if r.why and (r.samples_per_s or 0.0) > b.samples_per_s]
    if faster:
        top = max(faster, key=lambda r: r.samples_per_s or 0.0)
        line += f" ({top.label} would be {top.samples_per_s / b.samples_per_s:.2f}x but {top.why})"  # type: ignore[operator]
    if limit is not None:
        line += f"; memory limit {format_bytes(limit)} per worker"
    return line
