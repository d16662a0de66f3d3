"""Per-worker traces -> a Chrome trace JSON and a PNG timeline (PipeDream Figure 8 style), and the
numbers read off a trace (action durations, time per action kind, optimizer-step rates, message delivery).

A trace is, per worker (rank), a list of ``(action_text, start_s, end_s)`` records: what
``pipetrain.train(..., trace=True)`` returns in ``result.traces`` (``time.perf_counter`` seconds) and
what ``pipetrain.simulate.simulate`` predicts in ``SimResult.trace``. The same two functions draw both.

Clocks: ranks on different hosts need not share a clock origin, so by default each rank is shifted
to start at its own first event (every rank starts with an action at launch: a receive's record
includes its wait). Pass ``offsets`` (seconds subtracted from rank r) to align them otherwise, e.g.
the earliest start over all ranks when they ran on one host.
"""
from __future__ import annotations

import json
import os
import math
from collections import defaultdict
from collections.abc import Container, Sequence
from pathlib import Path

from pipetrain.schedule.actions import (
    BACKWARD, FORWARD, INPUT_GRAD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, SENDS, START_SYNC, SYNC, UPDATE,
    WEIGHT_GRAD, Action, Schedule,
)

Record = tuple[str, float, float]
Traces = Sequence[Sequence[Record]]

# kind -> (category, colour, bar height as a fraction of a lane): compute fills the lane; the rest
# is drawn as a thin bar at the lane's bottom so waits stay visible without hiding the compute.
_STYLE = {
    FORWARD: ("forward", "#4c72b0", 0.8),
    BACKWARD: ("backward", "#55a868", 0.8),
    INPUT_GRAD: ("input gradient", "#64b5cd", 0.8),
    WEIGHT_GRAD: ("weight gradient", "#8172b3", 0.8),
    RECV_ACT: ("send/receive", "#c8c8c8", 0.12),
    RECV_GRAD: ("send/receive", "#c8c8c8", 0.12),
    SEND_ACT: ("send/receive", "#c8c8c8", 0.12),
    SEND_GRAD: ("send/receive", "#c8c8c8", 0.12),
    START_SYNC: ("gradient sync", "#dd8452", 0.25),
    SYNC: ("gradient sync", "#dd8452", 0.25),
    UPDATE: ("update", "#404040", 0.25),
}

_COMPUTE = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


def aligned(traces: Traces, offsets: Sequence[float] | None = None) -> list[list[Record]]:
    """Shift every rank's times to start near 0.

    Args:
        traces: per rank, ``(action_text, start_s, end_s)`` records.
        offsets: seconds subtracted from rank r's times; None: each rank's own first start.

    Returns:
        The shifted records, per rank.

    Raises:
        ValueError: ``offsets`` does not have one entry per rank.
    """
    if offsets is None:
        offsets = first_starts(traces)
    if len(offsets) != len(traces):
        raise ValueError(f"{len(offsets)} offsets for {len(traces)} ranks; give one per rank")
    return [[(text, s - off, e - off) for text, s, e in t] for t, off in zip(traces, offsets)]


def first_starts(traces: Traces) -> list[float]:
    """Each rank's first start (0 for a rank without records): the default offsets of :func:`aligned`."""
    return [min((s for _, s, _ in t), default=0.0) for t in traces]


def _names(traces: Traces, names: Sequence[str] | None) -> list[str]:
    if names is None:
        return [f"worker {r}" for r in range(len(traces))]
    if len(names) != len(traces):
        raise ValueError(f"{len(names)} names for {len(traces)} ranks; give one per rank")
    return list(names)


def write_chrome_trace(traces: Traces, path: str | os.PathLike, names: Sequence[str] | None = None,
                       offsets: Sequence[float] | None = None,
                       memory: Sequence[Sequence[tuple[float, int, int]]] | None = None) -> None:
    """Write a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).

    Each rank is one process (``pid`` = rank, one thread) named ``names[r]``; each record is a
    complete event (``ph: "X"``) named by its action text, with ``cat`` its category (forward,
    backward, input gradient, weight gradient, send/receive, gradient sync, update) and times in microseconds.

    Args:
        traces: per rank, ``(action_text, start_s, end_s)`` records.
        path: the JSON file to write.
        names: one label per rank (default ``worker r``).
        offsets: see :func:`aligned`.
        memory: per rank, ``(time_s, activation bytes, weight bytes)`` samples of its stashed bytes
            (``TrainResult.memory_traces``), drawn as a counter track ``stashed bytes`` (``ph: "C"``).

    Raises:
        ValueError: a record's text is not an action, or ``names``/``offsets`` have the wrong length.
    """
    events: list[dict[str, object]] = []
    if offsets is None:
        offsets = first_starts(traces)
    for r, (name, records) in enumerate(zip(_names(traces, names), aligned(traces, offsets))):
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": r, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": r, "args": {"sort_index": r}})
        for text, start, end in records:
            events.append({"name": text, "cat": _STYLE[Action.parse(text).kind][0], "ph": "X",
                           "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6, "pid": r, "tid": r})
        for t, activations, weights in (memory[r] if memory and r < len(memory) else ()):
            events.append({"name": "stashed bytes", "ph": "C", "ts": (t - offsets[r]) * 1e6, "pid": r,
                           "args": {"activations": activations, "weights": weights}})
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")


def draw_timeline(traces: Traces, path: str | os.PathLike, title: str = "",
                  names: Sequence[str] | None = None, offsets: Sequence[float] | None = None,
                  width_in: float = 12.0) -> None:
    """Draw one lane per worker, worker 0 on top, time in ms, and save it as a PNG.

    Forward and backward boxes (a split backward's input- and weight-gradient parts too) are coloured
    differently and labelled with their minibatch id as in the action text (0-based; ``3.1`` is minibatch
    3's microbatch 1, ``3.1s2`` that of stage 2 on a worker holding several stages) where the box is wide
    enough.
    Sends, receives (including the wait for the message), gradient syncs and optimizer steps are
    thin bars at the bottom of the lane.

    Args:
        traces: per rank, ``(action_text, start_s, end_s)`` records.
        path: the PNG file to write.
        title: the figure title.
        names: one label per lane (default ``worker r``).
        offsets: see :func:`aligned`.
        width_in: figure width in inches.

    Raises:
        ValueError: a record's text is not an action, or ``names``/``offsets`` have the wrong length.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, safe in worker processes and CI
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = _names(traces, names)
    records = aligned(traces, offsets)
    span_ms = max((e for t in records for _, _, e in t), default=0.0) * 1e3 or 1.0
    height_in = 0.9 + 0.55 * len(lanes)
    fig, ax = plt.subplots(figsize=(width_in, height_in))
    left, right, bottom, top = 0.12, 0.98, 0.15, 0.88
    fig.subplots_adjust(left=left, right=right, bottom=bottom, top=top)
    axes_in, fontsize = width_in * (right - left), 8.0
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for r, lane in enumerate(records):
        for text, start, end in lane:
            a = Action.parse(text)
            x, w = start * 1e3, (end - start) * 1e3
            if w > 0:  # zero-length records (a free send, a free optimizer step) draw nothing
                bars[(r, a.kind)].append((x, w))
            label = (str(a.mb) if a.micro is None else f"{a.mb}.{a.micro}") + ("" if a.stage is None else f"s{a.stage}")
            # label only boxes wider than the text (a character is ~0.6 em wide)
            if a.kind in _COMPUTE and w / span_ms * axes_in > len(label) * fontsize * 0.6 / 72 + 0.02:
                ax.text(x + w / 2, r, label, ha="center", va="center", color="white", fontsize=fontsize)
    for (r, kind), spans in bars.items():
        _, colour, height = _STYLE[kind]
        compute = kind in _COMPUTE
        ax.broken_barh(spans, (r + 0.4 - height, height), facecolors=colour,
                       edgecolors="white" if compute else "none", linewidth=0.5, zorder=1 if compute else 2)
    kinds = {kind for _, kind in bars}
    used = {cat: colour for kind, (cat, colour, _) in _STYLE.items() if kind in kinds}
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # worker 0 on top, as in the paper's figures
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    below = 0.45 / (height_in * (top - bottom))  # 0.45 inch under the axes, clear of the time label
    ax.legend(handles=[Patch(color=c, label=k) for k, c in used.items()], loc="upper center",
              bbox_to_anchor=(0.5, -below), ncol=len(used), frameon=False, fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# -- reading traces -------------------------------------------------------------------------------------
def durations(records: Sequence[Record], kind: str, minibatches: Container[int] | None = None) -> list[float]:
    """Seconds of each ``kind`` action (``"F"``, ``"U"``, ...) in one rank's records, in order.

    Args:
        records: one rank's ``(action_text, start_s, end_s)`` records.
        kind: an action kind (:data:`pipetrain.schedule.actions.KINDS`).
        minibatches: only actions of these minibatch ids (e.g. ``range(6, 46)``); None: all.
    """
    return [e - s for text, s, e in records
            if (a := Action.parse(text)).kind == kind and (minibatches is None or a.mb in minibatches)]


def seconds_by_kind(records: Sequence[Record], start: float = -math.inf, end: float = math.inf) -> dict[str, float]:
    """Seconds one rank spent in each action kind inside ``[start, end]`` (records cut to the window).

    Kinds with no time in the window are absent. A receive's seconds include its wait.
    """
    out: dict[str, float] = defaultdict(float)
    for text, s, e in records:
        inside = min(e, end) - max(s, start)
        if inside > 0:
            out[Action.parse(text).kind] += inside
    return dict(out)


def update_ends(records: Sequence[Record]) -> list[float]:
    """When each optimizer step (``U``) of one rank's records ended, in order."""
    return [e for text, _, e in records if Action.parse(text).kind == UPDATE]


def step_rates(traces: Traces, batch_size: int) -> list[float]:
    """Samples/s of each optimizer step of the last rank (the output stage, on one worker): the batch
    size over the time since its previous step ended, or since the first record of any rank began.
    Ranks must share a clock (one host, or a simulated trace)."""
    ends = update_ends(traces[-1])
    start = min(t[0][1] for t in traces if t)
    return [batch_size / (b - a) for a, b in zip([start, *ends], ends)]


def deliveries(traces: Traces, schedule: Schedule) -> list[float]:
    """Seconds from each send starting to its receive returning, for the messages whose receiver was
    already waiting (so the time is the transport's, not the receiver's lateness).

    Args:
        traces: per rank, the records of a run of ``schedule`` whose ranks share a clock (one host).
        schedule: what ran; it says which rank each send goes to.
    """
    received: dict[tuple[int | None, Action], tuple[float, float]] = {
        (w, a): (s, e) for w, t in enumerate(traces) for text, s, e in t
        if (a := Action.parse(text)).kind in SENDS.values()}
    out = []
    for w, t in enumerate(traces):
        for text, s, _ in t:
            a = Action.parse(text)
            if a.kind in SENDS:
                recv = received.get((schedule.peer(w, a), a.counterpart()))
                if recv is not None and recv[0] < s:
                    out.append(recv[1] - s)
    return out
