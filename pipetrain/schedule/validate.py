"""Check a schedule: every send meets its receive, collectives line up, and nothing deadlocks.

A split backward's parts line up on each worker: a ``W`` after its ``I``, the gradient's send (``SB``)
after the ``I`` that computed it, and an update after every ``W`` of the minibatches it applies.

The check executes the action lists with unit costs: a send never blocks (the transport buffers it),
a receive waits for its matching send, a gradient sync's start ``A`` never blocks, and a worker's
k-th ``S`` (waiting for a gradient sync) waits until every worker of its stage has started its k-th
sync (``A``). If no worker can move, the schedule deadlocks and the error prints a worker x step grid
with the stuck step of each worker in brackets.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from pipetrain.schedule.actions import (
    BACKWARD, FORWARD, INPUT_GRAD, RECV_ACT, RECV_GRAD, SEND_GRAD, SENDS, START_SYNC, SYNC, UPDATE, WEIGHT_GRAD,
    Action, Schedule,
)


class ScheduleError(ValueError):
    """A schedule that cannot run: unmatched communication or a deadlock."""


def _grid(schedule: Schedule, pos: list[int], width: int = 12) -> str:
    rows = []
    for w, acts in enumerate(schedule.actions):
        lo = max(0, pos[w] - width // 2)
        cells = [f"[{a}]" if i == pos[w] else str(a) for i, a in enumerate(acts[lo:lo + width], lo)]
        stages = ",".join(map(str, schedule.stages_of(w)))
        rows.append(f"  w{w} (stage{'s' * (',' in stages)} {stages}) @{pos[w]:>3}: " + " ".join(cells))
    return "\n".join(rows)


def _check_matching(schedule: Schedule) -> None:
    sent: dict[tuple[int, int | None, Action], int] = defaultdict(int)  # (sender, receiver, receive)
    for w, acts in enumerate(schedule.actions):
        for a in acts:
            peer = schedule.peer(w, a)
            if a.kind in SENDS:
                sent[(w, peer, a.counterpart())] += 1
            elif peer is not None:
                sent[(peer, w, a)] -= 1
    bad = [k for k, v in sent.items() if v != 0]
    if bad:
        src, dst, what = bad[0]
        raise ScheduleError(f"schedule {schedule.name!r}: {what} between w{src} and w{dst} has a send "
                            f"without a receive or a receive without a send ({len(bad)} such)")


def _check_syncs(schedule: Schedule) -> None:
    """Every worker of a stage starts as many syncs (the same minibatches' syncs, in the same order,
    when the stage is sharded; a replicated pipeline stage syncs replica i's k-th minibatch with the
    other replicas' k-th), and waits for each once, after starting it, in the order it started them."""
    for s in range(schedule.num_stages if schedule.looped is None else 0):  # a looped schedule has no replicas
        first = schedule.first_worker(s)
        orders = []
        for w in range(first, first + schedule.replicas[s]):
            started = [a.mb for a in schedule.actions[w] if a.kind == START_SYNC]
            waited = [a.mb for a in schedule.actions[w] if a.kind == SYNC]
            if started != waited:
                raise ScheduleError(f"schedule {schedule.name!r}: w{w} starts syncs {started[:6]}... but waits "
                                    f"for {waited[:6]}...; every A needs one S, in the same order")
            pos = {a: i for i, a in enumerate(schedule.actions[w])}
            late = [mb for mb in started if pos[Action(SYNC, mb)] < pos[Action(START_SYNC, mb)]]
            if late:
                raise ScheduleError(f"schedule {schedule.name!r}: w{w} waits for the sync of minibatch "
                                    f"{late[0]} before starting it")
            orders.append(started)
        if any(len(o) != len(orders[0]) or (schedule.sharded and o != orders[0]) for o in orders):
            raise ScheduleError(f"schedule {schedule.name!r}: the workers of stage {s} start different gradient "
                                "syncs; each sync needs every worker of the stage")


def _check_split(schedule: Schedule) -> None:
    """Each ``I`` has one ``W`` after it on the same worker, an ``SB`` follows the ``I`` that computed
    its gradient, and a ``U`` of minibatch t comes after every ``W`` of minibatches up to t."""
    def fail(w: int, why: str) -> None:
        raise ScheduleError(f"schedule {schedule.name!r}: w{w} {why}")
    for w, acts in enumerate(schedule.actions):
        inputs = {(a.mb, a.micro): i for i, a in enumerate(acts) if a.kind == INPUT_GRAD}
        weights = [(i, a) for i, a in enumerate(acts) if a.kind == WEIGHT_GRAD]
        if not inputs and not weights:
            continue
        if sorted((a.mb, a.micro or 0) for _, a in weights) != sorted((mb, k or 0) for mb, k in inputs):
            fail(w, "needs one W for each I (a weight gradient for each input gradient)")
        for i, a in weights:
            if inputs.get((a.mb, a.micro), i) >= i:
                fail(w, f"runs {a} before {Action(INPUT_GRAD, a.mb, a.micro)}: a weight gradient comes after its "
                        "input gradient")
        last_w = {a.mb: i for i, a in weights}
        for i, a in enumerate(acts):
            if a.kind == SEND_GRAD and inputs.get((a.mb, a.micro), i) > i:
                fail(w, f"sends {a} before {Action(INPUT_GRAD, a.mb, a.micro)} computed it")
            if a.kind == UPDATE and any(mb <= a.mb and j > i for mb, j in last_w.items()):
                fail(w, f"updates at {a} before every W of the minibatches it applies")


def _sync_ready(schedule: Schedule, w: int, started: dict[tuple[int, int], int], waits: dict[int, int]) -> bool:
    """Worker ``w`` at its k-th sync: every worker of its stage has started its k-th sync (``started``
    counts them per (stage, k), so a stage of many replicas is checked in constant time)."""
    s = schedule.stage_of(w)
    return started[(s, waits[w])] == schedule.replicas[s]


def validate(schedule: Schedule) -> dict[str, list[int]]:
    """Raise ScheduleError if ``schedule`` cannot run; else return per-worker statistics.

    Returns:
        ``{"steps": [...], "peak_in_flight": [...]}``: the number of unit-time rounds each worker
        was active until done, and the most minibatches each worker held between the forward of their
        first microbatch and the backward (its ``W`` when split) of their last (counted per stage it holds).
    """
    _check_matching(schedule)
    _check_syncs(schedule)
    _check_split(schedule)
    acts = schedule.actions
    pos = [0] * schedule.num_workers
    done: set[tuple[int, Action]] = set()
    starts: dict[int, int] = defaultdict(int)  # worker -> A actions done
    started: dict[tuple[int, int], int] = defaultdict(int)  # (stage, k) -> workers that did their k-th A
    waits: dict[int, int] = defaultdict(int)  # worker -> S actions done
    in_flight = [set() for _ in acts]  # type: list[set[tuple[int, int | None]]]
    peak = [0] * schedule.num_workers
    steps = [0] * schedule.num_workers
    t = 0
    # only a worker that moved, or whose awaited message or sync start has come, can move next round: the
    # rest are not looked at again, so a round costs what moves in it, not the whole world
    active = {w for w, a in enumerate(acts) if a}
    asleep: dict[Any, list[int]] = defaultdict(list)  # what a blocked worker waits for -> the workers
    while active or any(p < len(a) for p, a in zip(pos, acts)):  # none active and some left: a deadlock
        t += 1
        moved = []
        for w in sorted(active):
            a = acts[w][pos[w]]
            sent = (schedule.peer(w, a), a.counterpart()) if a.kind in (RECV_ACT, RECV_GRAD) else None
            if sent is not None and sent not in done:
                asleep[sent].append(w)
            elif a.kind == SYNC and not _sync_ready(schedule, w, started, waits):
                asleep[(schedule.stage_of(w), waits[w])].append(w)
            else:
                moved.append((w, a))
        if not moved:
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks at round {t}; stuck steps in []:\n"
                                + _grid(schedule, pos))
        active = set()
        for w, a in moved:
            done.add((w, a))
            active.update(asleep.pop((w, a), ()))
            pos[w] += 1
            steps[w] = t
            if pos[w] < len(acts[w]):
                active.add(w)
            if a.kind == START_SYNC:
                stage = schedule.stage_of(w)
                started[(stage, starts[w])] += 1
                if started[(stage, starts[w])] == schedule.replicas[stage]:
                    active.update(asleep.pop((stage, starts[w]), ()))
                starts[w] += 1
            if a.kind == SYNC:
                waits[w] += 1
            if a.kind == FORWARD and a.micro in (None, 0):
                in_flight[w].add((a.mb, a.stage))
                peak[w] = max(peak[w], len(in_flight[w]))
            if a.kind in (BACKWARD, WEIGHT_GRAD) and a.micro in (None, schedule.microbatches - 1):
                in_flight[w].discard((a.mb, a.stage))
    return {"steps": steps, "peak_in_flight": peak}
