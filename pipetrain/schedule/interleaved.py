"""Interleaved 1F1B: W workers hold v * W stages looped, stage s on worker s mod W.

Megatron-LM's schedule with virtual pipeline stages (Narayanan et al., arXiv:2104.04473 §2.2) and
torch's ``ScheduleInterleaved1F1B``: each worker holds v stages of the model, so a microbatch visits
every worker v times and the pipeline's fill and drain take 1/v as long as 1F1B's over W stages.

Per minibatch of m microbatches, each worker runs its v * m forwards and v * m backwards:

* microbatches go in rounds of g = m / max(1, m // W) (W when m is a multiple of W, m when m < W);
  the k-th forward of a worker is of its stage (k // g) mod v (its 1st, 2nd, ... stage in turn), the
  k-th backward of its stage v - 1 - (k // g) mod v, each stage taking its microbatches in order;
* worker w warms up with (v - 1) * g + 2 * (W - 1 - w) forwards (Megatron's
  (v - 1) * W + 2 * (W - w - 1) when g = W), at most v * m, then alternates one forward and one
  backward, then drains its backwards;
* after its last backward, one update ``U`` steps every stage the worker holds (plain minibatch SGD).

The round size must divide m (torch's rule), or the turns would give some stage more than m forwards:
m = 9 on W = 4 workers is refused (rounds of 4 and 5), m = 5 runs in one round of 5.
"""
from __future__ import annotations

from collections import defaultdict

from pipetrain.schedule.actions import (
    BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, UPDATE, Action, Schedule,
)

Lists = list[list[Action]]


def round_size(workers: int, microbatches: int) -> int:
    """Microbatches a stage runs before the worker turns to its next stage (torch's rule)."""
    return microbatches // max(1, microbatches // workers)


def check(workers: int, stages: int, microbatches: int) -> None:
    """One-line ValueError unless ``stages`` stages loop over ``workers`` workers with ``microbatches``."""
    if workers < 2:
        raise ValueError(f"interleaved-1f1b needs workers >= 2, got {workers}; on one worker use 'gpipe' or "
                         "'1f1b-flush'")
    if stages % workers or stages < workers:
        raise ValueError(f"interleaved-1f1b places stages round robin on workers={workers}: give a multiple of "
                         f"{workers} stages (v stages per worker), not {stages}")
    rounds = max(1, microbatches // workers)
    if microbatches % rounds:
        raise ValueError(f"interleaved-1f1b runs microbatches in rounds of about workers={workers}: microbatches "
                         f"{microbatches} is not a multiple of {rounds} rounds; use a multiple of {workers} or "
                         f"fewer than {2 * workers}")


def order(workers: int, stages: int, minibatches: int, microbatches: int) -> Lists:
    """Each worker's forwards and backwards (with their stages) and one update per minibatch."""
    v, m = stages // workers, microbatches
    g, total = round_size(workers, m), v * m
    lists: Lists = []
    for w in range(workers):
        warm = min((v - 1) * g + 2 * (workers - 1 - w), total)
        acts: list[Action] = []
        for mb in range(minibatches):
            taken: dict[tuple[str, int], int] = defaultdict(int)

            def nth(kind: str, local: int) -> Action:
                s = local * workers + w
                k = taken[(kind, s)]
                taken[(kind, s)] += 1
                return Action(kind, mb, None if m == 1 else k, s)

            def fwd(k: int) -> Action:
                return nth(FORWARD, (k // g) % v)

            def bwd(k: int) -> Action:
                return nth(BACKWARD, v - 1 - (k // g) % v)

            acts += [fwd(k) for k in range(warm)]
            for k in range(total - warm):
                acts += [fwd(warm + k), bwd(k)]
            acts += [bwd(k) for k in range(total - warm, total)]
            acts.append(Action(UPDATE, mb))
        lists.append(acts)
    return lists


def p2p_pass(stages: int, compute: Lists) -> Lists:
    """Receive before and send after each forward and backward that crosses a stage boundary."""
    out: Lists = []
    for acts in compute:
        seq: list[Action] = []
        for a in acts:
            s = a.stage
            if a.kind == FORWARD and s is not None:
                seq += [Action(RECV_ACT, a.mb, a.micro, s)] if s > 0 else []
                seq += [a] + ([Action(SEND_ACT, a.mb, a.micro, s)] if s < stages - 1 else [])
            elif a.kind == BACKWARD and s is not None:
                seq += [Action(RECV_GRAD, a.mb, a.micro, s)] if s < stages - 1 else []
                seq += [a] + ([Action(SEND_GRAD, a.mb, a.micro, s)] if s > 0 else [])
            else:
                seq.append(a)
        out.append(seq)
    return out


def evaluation(workers: int, stages: int, minibatches: int, microbatches: int = 1) -> Schedule:
    """Forward only (evaluation): each worker runs microbatch by microbatch the forwards of its stages in
    order, so every forward waits only on one earlier in the same order elsewhere (no deadlock)."""
    micros = list(range(microbatches)) if microbatches > 1 else [None]
    compute = [[Action(FORWARD, mb, micro, s) for mb in range(minibatches) for micro in micros
                for s in range(w, stages, workers)] for w in range(workers)]
    return Schedule("evaluation", (1,) * stages, tuple(map(tuple, p2p_pass(stages, compute))), microbatches,
                    looped=workers)
