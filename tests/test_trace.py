"""Traces -> Chrome trace JSON and PNG timelines."""
from __future__ import annotations

import json

import pytest

from pipetrain.registry import GPipe, build_schedule
from pipetrain.simulate import simulate
from pipetrain.trace import (
    aligned, deliveries, draw_timeline, durations, seconds_by_kind, step_rates, update_ends, write_chrome_trace,
)
from test_simulate import equal_profile

# two ranks whose clocks have different origins, as perf_counter on two hosts
RUNTIME_LIKE = [[("F0", 100.0, 100.001), ("SF0", 100.001, 100.0011), ("RB0", 100.0011, 100.004),
                 ("B0", 100.004, 100.006), ("U0", 100.006, 100.0061)],
                [("RF0", 7.0, 7.0012), ("F0", 7.0012, 7.0022), ("B0", 7.0022, 7.0042),
                 ("SB0", 7.0042, 7.0043), ("U0", 7.0043, 7.0044)]]
# a data-parallel rank (a stage on two workers): it hands its gradient to the sync (A), then waits (S)
REPLICA = [[("F0", 0.0, 0.001), ("B0", 0.001, 0.003), ("A0", 0.003, 0.0031), ("S0", 0.0031, 0.004),
            ("U0", 0.004, 0.0041)]]


def test_aligned_shifts_each_rank_to_its_first_event_or_given_offsets():
    each = aligned(RUNTIME_LIKE)
    assert each[0][0][1] == 0.0 and each[1][0][1] == 0.0
    assert each[1][1][1:] == pytest.approx((0.0012, 0.0022))
    assert aligned(RUNTIME_LIKE, [99.0, 6.0])[0][0][1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one per rank"):
        aligned(RUNTIME_LIKE, [0.0])


def test_chrome_trace_structure(tmp_path):
    path = tmp_path / "t.json"
    write_chrome_trace(RUNTIME_LIKE, path, names=["stage 0", "stage 1"])
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 10
    assert {e["pid"] for e in complete} == {0, 1}
    first = complete[0]
    assert (first["name"], first["cat"], first["ts"]) == ("F0", "forward", 0.0)
    assert first["dur"] == pytest.approx(1000.0)  # microseconds
    assert {e["cat"] for e in complete} == {"forward", "backward", "send/receive", "update"}
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "stage 0", 1: "stage 1"}
    write_chrome_trace(REPLICA, path)
    cats = [e["cat"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert cats == ["forward", "backward", "gradient sync", "gradient sync", "update"]


def test_png_timeline_written_for_runtime_and_simulated_traces(tmp_path):
    sim = simulate(build_schedule("pipedream", [1] * 4, 8), equal_profile(4), [0, 1, 2, 3])
    replicated = simulate(build_schedule("pipedream", [2], 4), equal_profile(1), [0])
    assert "A0" in [text for text, _, _ in replicated.trace[0]]
    for name, traces in (("runtime.png", RUNTIME_LIKE), ("sim.png", sim.trace), ("replicas.png", replicated.trace),
                         ("replica.png", REPLICA)):
        path = tmp_path / name
        draw_timeline(traces, path, title=name)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bad_action_text_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="cannot parse action"):
        write_chrome_trace([[("X0", 0.0, 1.0)]], tmp_path / "t.json")


def test_durations_seconds_by_kind_and_step_rates():
    records = RUNTIME_LIKE[0]
    assert durations(records, "F") == pytest.approx([0.001])
    assert durations(records, "RB", minibatches=range(1, 5)) == []
    by_kind = seconds_by_kind(records, 100.0005, 100.005)
    assert by_kind == pytest.approx({"F": 0.0005, "SF": 0.0001, "RB": 0.0029, "B": 0.001})
    assert update_ends(records) == [100.0061]
    sim = simulate(build_schedule(GPipe(microbatches=2), [1, 1], 4), equal_profile(4), [0, 2], batch_size=8)
    ends = update_ends(sim.trace[-1])
    rates = step_rates(sim.trace, 8)
    assert len(rates) == 4 and rates[-1] == pytest.approx(8 / (ends[-1] - ends[-2]))


def test_deliveries_pair_each_send_with_its_waiting_receive():
    """Rank 1 waits for F0 from 7.0; it is sent at 7.0005 and arrives at 7.0012. B0's gradient is
    received by a rank that was not yet waiting, so it does not count."""
    schedule = build_schedule("model-parallel", [1, 1], 1)
    traces = [[("F0", 7.0, 7.0005), ("SF0", 7.0005, 7.0006), ("RB0", 7.005, 7.006), ("B0", 7.006, 7.007),
               ("U0", 7.007, 7.0071)],
              [("RF0", 7.0, 7.0012), ("F0", 7.0012, 7.0022), ("B0", 7.0022, 7.0042), ("SB0", 7.0042, 7.0043),
               ("U0", 7.0043, 7.0044)]]
    assert deliveries(traces, schedule) == pytest.approx([0.0007])
