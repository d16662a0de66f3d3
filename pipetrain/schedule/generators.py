"""Schedule generators: pure functions from (replicas per stage, minibatch count) to a Schedule.

Each generator first orders the compute (F/B) of every worker, then :func:`add_communication`
inserts the receives, sends, gradient syncs and optimizer steps that order implies. For n = 4
stages and 6 minibatches, ``pipedream`` (PipeDream §3.3, Figure 8; NOAM = 4) orders compute as::

    stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
    stage 1:    F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5
    stage 2:       F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5
    stage 3:          F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5

and ``gpipe`` with 4 microbatches orders each minibatch as ``F0.0 F0.1 F0.2 F0.3 B0.0 ... B0.3 U0``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pipetrain.schedule.actions import (
    BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, SYNC, UPDATE, Action, Schedule,
)

SCHEDULES = ("pipedream", "naive", "gpipe", "1f1b-flush", "model-parallel")
FLUSH_SCHEDULES = ("gpipe", "1f1b-flush", "model-parallel")


def noam(replicas: Sequence[int]) -> int:
    """NUM_OPT_ACTIVE_MINIBATCHES = ceil(workers / workers of the input stage) (PipeDream §3.3)."""
    return math.ceil(sum(replicas) / replicas[0])


def warmup(replicas: Sequence[int], stage: int) -> int:
    """Forwards a worker of ``stage`` runs before its first backward under 1F1B.

    The input stage admits NOAM minibatches; in general a replica of stage s keeps
    ceil(workers in stages s.. / replicas of s) of its own minibatches in flight, which is n - s for
    a straight pipeline (the output stage holds 1).
    """
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


def _one_f_one_b(items: list[tuple[int, int | None]], w: int) -> list[Action]:
    """``w`` forwards, then alternate one backward and one forward, then drain the backwards."""
    out: list[Action] = []
    w = min(w, len(items))
    for i in range(len(items) + w):
        if i >= w:
            out.append(Action(BACKWARD, *items[i - w]))
        if i < len(items):
            out.append(Action(FORWARD, *items[i]))
    return out


def _pipedream_compute(replicas: Sequence[int], minibatches: int) -> list[list[Action]]:
    lists: list[list[Action]] = []
    for s, r in enumerate(replicas):
        for i in range(r):
            own = [(mb, None) for mb in range(i, minibatches, r)]
            lists.append(_one_f_one_b(own, warmup(replicas, s)))
    return lists


def _flush_compute(replicas: Sequence[int], minibatches: int, microbatches: int,
                   order: Callable[[int, int, int], list[Action]]) -> list[list[Action]]:
    n = len(replicas)
    return [[a for mb in range(minibatches) for a in order(s, n, mb)] for s in range(n)]


def _check(replicas: Sequence[int], minibatches: int, microbatches: int, name: str) -> None:
    if not replicas or any(r < 1 for r in replicas):
        raise ValueError(f"replicas per stage must be positive integers, got {list(replicas)}")
    if minibatches < 0 or microbatches < 1:
        raise ValueError(f"need minibatches >= 0 and microbatches >= 1, got {minibatches}, {microbatches}")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name in FLUSH_SCHEDULES and any(r != 1 for r in replicas):
        raise ValueError(f"schedule {name!r} runs straight pipelines only (one worker per stage); "
                         f"use 'pipedream' for replicated stages {list(replicas)}")
    lcm = math.lcm(*replicas)
    if minibatches % lcm:
        raise ValueError(f"{minibatches} minibatches do not split evenly over replicas {list(replicas)}; "
                         f"use a multiple of {lcm} so every replica joins every gradient sync")
    if name not in ("gpipe", "1f1b-flush") and microbatches != 1:
        raise ValueError(f"schedule {name!r} does not split minibatches; use microbatches=1 "
                         "or the 'gpipe' / '1f1b-flush' schedules")


def build_schedule(name: str, replicas: Sequence[int], minibatches: int, microbatches: int = 1) -> Schedule:
    """Build the named schedule.

    Args:
        name: one of ``pipedream``, ``naive`` (same order, no weight stashing at run time),
            ``gpipe``, ``1f1b-flush``, ``model-parallel``.
        replicas: workers per stage (all 1 for a straight pipeline).
        minibatches: minibatches to train.
        microbatches: microbatches per minibatch (``gpipe`` and ``1f1b-flush`` only).

    Returns:
        The schedule, with communication, syncs and optimizer steps inserted.

    Raises:
        ValueError: unknown name, bad counts, or a flush schedule asked to replicate a stage.
    """
    _check(replicas, minibatches, microbatches, name)
    m = microbatches
    if name in ("pipedream", "naive"):
        compute = _pipedream_compute(replicas, minibatches)
    elif name == "gpipe":
        compute = _flush_compute(replicas, minibatches, m, lambda s, n, mb: (
            [Action(FORWARD, mb, k) for k in range(m)] + [Action(BACKWARD, mb, k) for k in range(m)]))
    elif name == "1f1b-flush":
        compute = _flush_compute(replicas, minibatches, m, lambda s, n, mb: _one_f_one_b(
            [(mb, k) for k in range(m)], n - s))
    else:  # model-parallel: one minibatch in the whole pipeline at a time
        compute = _flush_compute(replicas, minibatches, m, lambda s, n, mb: [
            Action(FORWARD, mb), Action(BACKWARD, mb)])
    if m == 1 and name in ("gpipe", "1f1b-flush"):
        compute = [[Action(a.kind, a.mb) for a in acts] for acts in compute]
    return add_communication(name, tuple(replicas), compute, m)


def add_communication(name: str, replicas: tuple[int, ...], compute: list[list[Action]],
                      microbatches: int) -> Schedule:
    """Insert receives before and sends after each compute action, and the optimizer steps.

    ``pipedream``/``naive`` step after every backward (a replicated stage first waits for the
    replicas' gradient sync ``S``); flush schedules step once after a minibatch's last backward.
    """
    n = len(replicas)
    out: list[tuple[Action, ...]] = []
    for w, acts in enumerate(compute):
        s = next(st for st in range(n) if w < sum(replicas[:st + 1]))
        seq: list[Action] = []
        for a in acts:
            if a.kind == FORWARD:
                seq += ([Action(RECV_ACT, a.mb, a.micro)] if s > 0 else []) + [a]
                seq += [Action(SEND_ACT, a.mb, a.micro)] if s < n - 1 else []
            else:
                seq += ([Action(RECV_GRAD, a.mb, a.micro)] if s < n - 1 else []) + [a]
                seq += [Action(SEND_GRAD, a.mb, a.micro)] if s > 0 else []
                last_micro = a.micro is None or a.micro == microbatches - 1
                if name in FLUSH_SCHEDULES and last_micro:
                    seq.append(Action(UPDATE, a.mb))
                elif name not in FLUSH_SCHEDULES:
                    seq += ([Action(SYNC, a.mb)] if replicas[s] > 1 else []) + [Action(UPDATE, a.mb)]
        out.append(tuple(seq))
    return Schedule(name, replicas, tuple(out), microbatches, noam(replicas))
