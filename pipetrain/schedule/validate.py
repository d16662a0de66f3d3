"""Check a schedule: every send meets its receive, collectives line up, and nothing deadlocks.

The check executes the action lists with unit costs: a send never blocks (the transport buffers it),
a receive waits for its matching send, and a replicated stage's k-th ``S`` (gradient sync) waits for
the k-th ``S`` of every replica. If no worker can move, the schedule deadlocks and the error prints a
worker x step grid with the stuck step of each worker in brackets.
"""
from __future__ import annotations

from collections import defaultdict

from pipetrain.schedule.actions import (
    BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SENDS, SYNC, Action, Schedule,
)


class ScheduleError(ValueError):
    """A schedule that cannot run: unmatched communication or a deadlock."""


def _grid(schedule: Schedule, pos: list[int], width: int = 12) -> str:
    rows = []
    for w, acts in enumerate(schedule.actions):
        lo = max(0, pos[w] - width // 2)
        cells = [f"[{a}]" if i == pos[w] else str(a) for i, a in enumerate(acts[lo:lo + width], lo)]
        rows.append(f"  w{w} (stage {schedule.stage_of(w)}) @{pos[w]:>3}: " + " ".join(cells))
    return "\n".join(rows)


def _check_matching(schedule: Schedule) -> None:
    sent: dict[tuple[int, int, str, int, int | None], int] = defaultdict(int)
    for w, acts in enumerate(schedule.actions):
        for a in acts:
            peer = schedule.peer(w, a)
            if a.kind in SENDS:
                sent[(w, peer, SENDS[a.kind], a.mb, a.micro)] += 1  # type: ignore[index]
            elif peer is not None:
                sent[(peer, w, a.kind, a.mb, a.micro)] -= 1
    bad = [k for k, v in sent.items() if v != 0]
    if bad:
        src, dst, kind, mb, micro = bad[0]
        what = Action(kind, mb, micro)
        raise ScheduleError(f"schedule {schedule.name!r}: {what} between w{src} and w{dst} has a send "
                            f"without a receive or a receive without a send ({len(bad)} such)")


def _sync_ready(schedule: Schedule, w: int, pos: list[int], syncs_done: dict[int, int]) -> bool:
    """Worker ``w`` waits at its k-th sync: every replica mate has passed or reached its k-th."""
    s = schedule.stage_of(w)
    first = schedule.first_worker(s)
    k = syncs_done[w]
    for m in range(first, first + schedule.replicas[s]):
        at_sync = pos[m] < len(schedule.actions[m]) and schedule.actions[m][pos[m]].kind == SYNC
        if not (syncs_done[m] > k or (syncs_done[m] == k and at_sync)):
            return False
    return True


def validate(schedule: Schedule) -> dict[str, list[int]]:
    """Raise ScheduleError if ``schedule`` cannot run; else return per-worker statistics.

    Returns:
        ``{"steps": [...], "peak_in_flight": [...]}``: the number of unit-time rounds each worker
        was active until done, and the most minibatches each worker held between the forward and
        the backward of their first microbatch.
    """
    _check_matching(schedule)
    acts = schedule.actions
    pos = [0] * schedule.num_workers
    done: set[tuple[int, Action]] = set()
    syncs_done: dict[int, int] = defaultdict(int)  # worker -> completed S count
    in_flight = [set() for _ in acts]  # type: list[set[int]]
    peak = [0] * schedule.num_workers
    steps = [0] * schedule.num_workers
    t = 0
    while any(p < len(a) for p, a in zip(pos, acts)):
        t += 1
        moved = []
        for w, a_list in enumerate(acts):
            if pos[w] >= len(a_list):
                continue
            a = a_list[pos[w]]
            if a.kind in (RECV_ACT, RECV_GRAD):
                send_kind = "SF" if a.kind == RECV_ACT else "SB"
                if (schedule.peer(w, a), Action(send_kind, a.mb, a.micro)) not in done:
                    continue
            if a.kind == SYNC and not _sync_ready(schedule, w, pos, syncs_done):
                continue
            moved.append((w, a))
        if not moved:
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks at round {t}; stuck steps in []:\n"
                                + _grid(schedule, pos))
        for w, a in moved:
            done.add((w, a))
            pos[w] += 1
            steps[w] = t
            if a.kind == SYNC:
                syncs_done[w] += 1
            if a.kind == FORWARD and a.micro in (None, 0):
                in_flight[w].add(a.mb)
                peak[w] = max(peak[w], len(in_flight[w]))
            if a.kind == BACKWARD and a.micro in (None, schedule.microbatches - 1):
                in_flight[w].discard(a.mb)
    return {"steps": steps, "peak_in_flight": peak}
