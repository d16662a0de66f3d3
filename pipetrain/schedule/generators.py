"""Schedule generators: pure functions from a layout and a minibatch count to per-worker action lists.

A schedule is built in three passes:

1. a **compute order**: each worker's forwards and backwards (``F``/``B``; ``zero-bubble`` splits each
   backward into ``I`` and ``W``);
2. the **point-to-point pass** (:func:`p2p_pass`): a receive before and a send after each compute
   action that crosses a stage boundary (``RF``/``SF``/``RB``/``SB``);
3. a **sync pass** owned by the strategy: where gradients are handed to the synchronizer (``A``),
   waited for (``S``) and applied (``U``): :func:`flush_sync`, :func:`split_flush_sync`, :func:`step_sync`,
   :func:`deferred_sync`
   or :func:`stale_sync`.

For n = 4 stages and 6 minibatches, ``pipedream`` (PipeDream §3.3, Figure 8; NOAM = 4) orders
compute as::

    stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
    stage 1:    F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5
    stage 2:       F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5
    stage 3:          F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5

``2bw`` with 2 stages and 2 microbatches runs 1F1B over the stream of all microbatches, an update
after each minibatch's last backward and no flush::

    stage 0: F0.0 F0.1 B0.0 F1.0 B0.1 U0 F1.1 B1.0 F2.0 B1.1 U1 F2.1 B2.0 B2.1 U2
    stage 1: F0.0 B0.0 F0.1 B0.1 U0 F1.0 B1.0 F1.1 B1.1 U1 F2.0 B2.0 F2.1 B2.1 U2

``gpipe`` with 4 microbatches orders each minibatch as ``F0.0 F0.1 F0.2 F0.3 B0.0 ... B0.3 U0``, and
data parallelism with staleness K = 2 (Pipe-SGD, Alg. 1) gives every worker::

    F0 B0 A0 F1 B1 A1 S0 U0 F2 B2 A2 S1 U1 ... F5 B5 A5 S4 U4 S5 U5
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from pipetrain.layout import Layout
from pipetrain.schedule.actions import (
    BACKWARD, FORWARD, INPUT_GRAD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, START_SYNC, SYNC, UPDATE, WEIGHT_GRAD,
    Action, Schedule,
)

Lists = list[list[Action]]


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


# -- 1. compute orders ------------------------------------------------------------------------------

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


def _micro(mb: int, k: int, microbatches: int) -> tuple[int, int | None]:
    return (mb, None) if microbatches == 1 else (mb, k)


def pipedream_order(replicas: Sequence[int], minibatches: int, microbatches: int = 1) -> Lists:
    """1F1B with NOAM in flight (PipeDream §3.3); replica i of a stage takes minibatches i, i+r, ..."""
    lists: Lists = []
    for s, r in enumerate(replicas):
        for i in range(r):
            own: list[tuple[int, int | None]] = [(mb, None) for mb in range(i, minibatches, r)]
            lists.append(_one_f_one_b(own, warmup(replicas, s)))
    return lists


def two_bw_order(replicas: Sequence[int], minibatches: int, microbatches: int) -> Lists:
    """1F1B over the stream of every microbatch of every minibatch, stage s warming up with n - s and no
    flush between minibatches (PipeDream-2BW); replica i of a stage of r keeps the stage's order of
    minibatches i, i+r, ..."""
    n, m = len(replicas), microbatches
    lists: Lists = []
    for s, r in enumerate(replicas):
        order = _one_f_one_b([_micro(mb, k, m) for mb in range(minibatches) for k in range(m)], n - s)
        lists += [[a for a in order if a.mb % r == i] for i in range(r)]
    return lists


def gpipe_order(replicas: Sequence[int], minibatches: int, microbatches: int = 1) -> Lists:
    """Per minibatch: every microbatch's forward, then every backward (GPipe, arXiv:1811.06965)."""
    m = microbatches
    return [[Action(kind, *_micro(mb, k, m)) for mb in range(minibatches) for kind in (FORWARD, BACKWARD)
             for k in range(m)] for _ in replicas]


def one_f_one_b_flush_order(replicas: Sequence[int], minibatches: int, microbatches: int = 1) -> Lists:
    """Per minibatch: 1F1B over its microbatches, stage s warming up with n - s (PipeDream-Flush)."""
    n, m = len(replicas), microbatches
    return [[a for mb in range(minibatches) for a in _one_f_one_b([_micro(mb, k, m) for k in range(m)], n - s)]
            for s in range(n)]


def zero_bubble_order(replicas: Sequence[int], minibatches: int, microbatches: int = 1) -> Lists:
    """ZB-H1 (Qi et al., ICLR'24, §3.1) per minibatch: 1F1B's order of forwards and input-gradient
    backwards (``I``), stage s warming up with n - s, and each weight-gradient backward (``W``) s
    ``I``'s after its own, so that stage s ends with s + 1 ``W``'s filling its tail bubble. A stage
    holds at most n microbatches between their forward and their ``W``: 1F1B's most (stage 0's)."""
    n, m = len(replicas), microbatches
    return [[a for mb in range(minibatches) for a in _zb_h1([_micro(mb, k, m) for k in range(m)], n - s, s)]
            for s in range(n)]


def _zb_h1(items: list[tuple[int, int | None]], w: int, lag: int) -> list[Action]:
    """1F1B's order with each backward an ``I``, each followed by the ``W`` of the ``I`` ``lag`` before
    it; the ``W``'s left come last."""
    out: list[Action] = []
    done = 0  # I's so far
    for a in _one_f_one_b(items, w):
        if a.kind == FORWARD:
            out.append(a)
            continue
        out.append(Action(INPUT_GRAD, a.mb, a.micro))
        if done >= lag:
            out.append(Action(WEIGHT_GRAD, *items[done - lag]))
        done += 1
    return out + [Action(WEIGHT_GRAD, *it) for it in items[max(0, len(items) - lag):]]


def model_parallel_order(replicas: Sequence[int], minibatches: int, microbatches: int = 1) -> Lists:
    """One minibatch in the whole pipeline at a time."""
    return [[Action(kind, mb) for mb in range(minibatches) for kind in (FORWARD, BACKWARD)] for _ in replicas]


def data_parallel_order(workers: int, minibatches: int) -> Lists:
    """Every worker runs the forward and backward of every minibatch, on its shard of the samples."""
    return [[Action(kind, mb) for mb in range(minibatches) for kind in (FORWARD, BACKWARD)]
            for _ in range(workers)]


# -- 2. point-to-point pass -------------------------------------------------------------------------

def p2p_pass(replicas: Sequence[int], compute: Lists) -> Lists:
    """Receive before and send after each compute action that crosses a stage boundary."""
    n, layout = len(replicas), Layout(tuple(replicas))
    out: Lists = []
    for w, acts in enumerate(compute):
        s, seq = layout.stage_of(w), []
        for a in acts:
            if a.kind == FORWARD:
                seq += ([Action(RECV_ACT, a.mb, a.micro)] if s > 0 else []) + [a]
                seq += [Action(SEND_ACT, a.mb, a.micro)] if s < n - 1 else []
            elif a.kind == WEIGHT_GRAD:  # nothing crosses a cut: the I before it sent the gradient
                seq.append(a)
            else:
                seq += ([Action(RECV_GRAD, a.mb, a.micro)] if s < n - 1 else []) + [a]
                seq += [Action(SEND_GRAD, a.mb, a.micro)] if s > 0 else []
        out.append(seq)
    return out


# -- 3. sync passes ---------------------------------------------------------------------------------

def _after_backwards(acts: list[Action], extra: Callable[[Action], list[Action]]) -> list[Action]:
    """``acts`` with ``extra(b)`` inserted after each backward ``b`` (after the send of its gradient)."""
    out: list[Action] = []
    for i, a in enumerate(acts):
        out.append(a)
        if a.kind == SEND_GRAD or (a.kind == BACKWARD and (i + 1 == len(acts) or acts[i + 1].kind != SEND_GRAD)):
            out += extra(Action(BACKWARD, a.mb, a.micro))
    return out


def flush_sync(lists: Lists, microbatches: int) -> Lists:
    """One update per minibatch, after the backward of its last microbatch (flush schedules)."""
    def extra(b: Action) -> list[Action]:
        return [Action(UPDATE, b.mb)] if b.micro in (None, microbatches - 1) else []
    return [_after_backwards(acts, extra) for acts in lists]


def split_flush_sync(lists: Lists) -> Lists:
    """One update per minibatch, after the last of its weight-gradient backwards (``W``) on each worker."""
    out = []
    for acts in lists:
        last = {a.mb: i for i, a in enumerate(acts) if a.kind == WEIGHT_GRAD}
        seq = []
        for i, a in enumerate(acts):
            seq.append(a)
            if last.get(a.mb) == i:
                seq.append(Action(UPDATE, a.mb))
        out.append(seq)
    return out


def step_sync(lists: Lists, replicas: Sequence[int]) -> Lists:
    """An update after every backward; a replicated stage first syncs the gradient with its replicas
    (``A`` after the backward, whose hooks have already started the allreduce, then ``S``)."""
    layout = Layout(tuple(replicas))

    def extra(b: Action, replicated: bool) -> list[Action]:
        return ([Action(START_SYNC, b.mb), Action(SYNC, b.mb)] if replicated else []) + [Action(UPDATE, b.mb)]
    return [_after_backwards(acts, functools.partial(extra, replicated=replicas[layout.stage_of(w)] > 1))
            for w, acts in enumerate(lists)]


def unsynced_tail(lists: Lists, replicas: Sequence[int], minibatches: int) -> Lists:
    """``lists`` without the sync (``A``, ``S``) of a replicated stage's last round where ``minibatches``
    leaves it partial (minibatches from the last multiple of the stage's replicas on): its replicas
    update alone, so the rest of a window of any length can be simulated (see
    :meth:`pipetrain.schedule.kinds.PipelineSchedule.window`)."""
    layout = Layout(tuple(replicas))
    out: Lists = []
    for w, acts in enumerate(lists):
        r = replicas[layout.stage_of(w)]
        whole = minibatches - minibatches % r
        out.append([a for a in acts if a.kind not in (START_SYNC, SYNC) or a.mb < whole])
    return out


def deferred_sync(lists: Lists, replicas: Sequence[int], microbatches: int) -> Lists:
    """2bw's sync pass: a stage on one worker updates after each minibatch's last backward (as
    :func:`flush_sync` does); a replica starts the sync of its minibatch there (``A``) but waits for it and
    updates (``S``, ``U``) only before the backward of its next minibatch. Meanwhile it runs the forwards
    its other replicas' last backwards of the round wait for, and those forwards use the version before
    the update anyway."""
    layout = Layout(tuple(replicas))
    out = flush_sync(lists, microbatches)
    for w, acts in enumerate(lists):
        if replicas[layout.stage_of(w)] == 1:
            continue
        started = _after_backwards(acts, lambda b: [Action(START_SYNC, b.mb)] if b.micro in (None, microbatches - 1)
                                   else [])
        seq: list[Action] = []
        pending: int | None = None
        for a in started:
            if a.kind in (RECV_GRAD, BACKWARD) and pending is not None and a.mb != pending:
                seq += [Action(SYNC, pending), Action(UPDATE, pending)]
                pending = None
            seq.append(a)
            if a.kind == START_SYNC:
                pending = a.mb
        out[w] = seq + ([Action(SYNC, pending), Action(UPDATE, pending)] if pending is not None else [])
    return out


def stale_sync(lists: Lists, staleness: int) -> Lists:
    """Pipe-SGD's rule (Alg. 1, §3.1): the gradient of minibatch t is handed to the synchronizer right
    after its backward and applied after the backward of t + K - 1, so the sync of t overlaps the
    compute of the next K - 1 minibatches. The last K - 1 syncs are drained at the end (the epoch's
    every gradient is applied once). K = 1 is plain synchronous SGD."""
    if staleness < 1:
        raise ValueError(f"staleness={staleness} must be at least 1 (1 is synchronous SGD)")

    def extra(b: Action) -> list[Action]:
        k = b.mb - staleness + 1
        return [Action(START_SYNC, b.mb)] + ([Action(SYNC, k), Action(UPDATE, k)] if k >= 0 else [])
    out = []
    for acts in lists:
        mbs = [a.mb for a in acts if a.kind == BACKWARD]
        tail = [Action(kind, k) for k in mbs[max(0, len(mbs) - staleness + 1):] for kind in (SYNC, UPDATE)]
        out.append(_after_backwards(acts, extra) + tail)
    return out


def data_parallel(workers: int, minibatches: int, staleness: int = 1, name: str = "data-parallel") -> Schedule:
    """Data parallelism's schedule: every worker runs every minibatch's shard, then Pipe-SGD's sync pass
    with ``staleness`` K (:func:`stale_sync`; K = 1 is synchronous SGD). ``name`` labels it.

    Raises:
        ValueError: workers < 1, minibatches < 0, or staleness < 1.
    """
    if workers < 1 or minibatches < 0:
        raise ValueError(f"need workers >= 1 and minibatches >= 0, got {workers}, {minibatches}")
    lists = stale_sync(p2p_pass([workers], data_parallel_order(workers, minibatches)), staleness)
    return Schedule(name, (workers,), tuple(map(tuple, lists)), sharded=True)


def evaluation(replicas: Sequence[int], minibatches: int, sharded: bool = False, microbatches: int = 1) -> Schedule:
    """Forward only (evaluation at an epoch's end): each minibatch through every stage, replica
    ``mb mod r`` of each, in the ``microbatches`` the training runs (a stage captured by ``torch.export``
    is made for that microbatch's shapes); ``sharded`` (data parallelism): every worker runs every
    minibatch on its shard."""
    micros = list(range(microbatches)) if microbatches > 1 else [None]
    if sharded:
        compute = [[Action(FORWARD, mb) for mb in range(minibatches)] for _ in range(replicas[0])]
    else:
        compute = [[Action(FORWARD, mb, micro) for mb in range(i, minibatches, r) for micro in micros]
                   for r in replicas for i in range(r)]
    return Schedule("evaluation", tuple(replicas), tuple(tuple(acts) for acts in p2p_pass(replicas, compute)),
                    microbatches if not sharded else 1, sharded=sharded)
