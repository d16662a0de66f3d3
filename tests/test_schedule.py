"""Schedules as data: exact orders, text round trip, deadlock freedom and in-flight counts."""
import pytest

from pipetrain.registry import GPipe, OneFOneBFlush, build_schedule, make, schedule_of
from pipetrain.schedule import Action, Schedule, ScheduleError, noam, validate

# PipeDream Figure 8 (n = 4, NOAM = 4): compute order per stage, 0-based minibatch ids.
FIGURE_8 = """
F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5
F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5
F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5
"""


def compute_only(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in acts if a.kind in "FB") for acts in schedule.actions]


def test_pipedream_matches_figure_8():
    s = build_schedule("pipedream", [1, 1, 1, 1], 6)
    assert compute_only(s) == FIGURE_8.strip().splitlines()
    assert s.noam == 4


def test_pipedream_inserts_communication_and_one_update_per_minibatch():
    s = build_schedule("pipedream", [1, 1], 2)
    assert " ".join(map(str, s.actions[0])) == "F0 SF0 F1 SF1 RB0 B0 U0 RB1 B1 U1"
    assert " ".join(map(str, s.actions[1])) == "RF0 F0 B0 SB0 U0 RF1 F1 B1 SB1 U1"


def test_gpipe_flushes_after_all_microbatches():
    s = build_schedule(GPipe(microbatches=2), [1, 1], 2)
    assert " ".join(map(str, s.actions[0])) == (
        "F0.0 SF0.0 F0.1 SF0.1 RB0.0 B0.0 RB0.1 B0.1 U0 F1.0 SF1.0 F1.1 SF1.1 RB1.0 B1.0 RB1.1 B1.1 U1")


def test_one_f_one_b_flush_order_within_minibatch():
    s = build_schedule(OneFOneBFlush(microbatches=4), [1, 1, 1], 1)
    assert compute_only(s) == ["F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3",
                               "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3",
                               "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3"]


def test_model_parallel_keeps_one_minibatch_in_the_pipeline():
    s = build_schedule("model-parallel", [1, 1, 1], 3)
    assert compute_only(s) == ["F0 B0 F1 B1 F2 B2"] * 3
    assert validate(s)["peak_in_flight"] == [1, 1, 1]


def test_naive_has_the_pipedream_order():
    assert build_schedule("naive", [1, 1, 1], 5).actions == build_schedule("pipedream", [1, 1, 1], 5).actions


@pytest.mark.parametrize("name,micro", [("pipedream", 1), ("naive", 1), ("gpipe", 3), ("1f1b-flush", 3),
                                        ("1f1b-flush", 1), ("model-parallel", 1)])
@pytest.mark.parametrize("n", range(1, 9))
def test_deadlock_free_and_in_flight_counts(name, micro, n):
    s = build_schedule(schedule_of(name, micro), [1] * n, 2 * n + 3)
    peak = validate(s)["peak_in_flight"]
    if name in ("pipedream", "naive"):
        assert peak[0] == noam([1] * n) == n  # the input stage holds NOAM minibatches
        assert peak[-1] == 1                  # the output stage one
        assert peak == [n - s for s in range(n)]
    else:
        assert peak == [1] * n                # flush: one minibatch at a time per stage


@pytest.mark.parametrize("replicas", [(2, 1), (3, 1), (1, 2), (2, 2, 1), (3, 2, 1)])
def test_replicated_pipedream_is_deadlock_free(replicas):
    import math
    s = build_schedule("pipedream", replicas, 4 * math.lcm(*replicas))
    peak = validate(s)["peak_in_flight"]
    assert peak[0] == noam(replicas) == math.ceil(sum(replicas) / replicas[0])
    assert peak[-1] == 1


def test_text_form_round_trips():
    for s in (build_schedule("pipedream", [2, 1], 4), build_schedule(GPipe(microbatches=2), [1, 1, 1], 2)):
        assert Schedule.from_text(s.to_text()) == s
    assert Action.parse("F3.1") == Action("F", 3, 1) and str(Action("RB", 7)) == "RB7"
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse("X3")


def test_deadlock_is_reported_with_a_grid():
    bad = Schedule("bad", (1, 1), ((Action("RB", 0), Action("F", 0), Action("SF", 0), Action("B", 0)),
                                   (Action("RF", 0), Action("F", 0), Action("B", 0), Action("SB", 0))))
    with pytest.raises(ScheduleError, match=r"deadlocks(.|\n)*\[RB0\](.|\n)*\[RF0\]"):
        validate(bad)


def test_unmatched_send_is_reported():
    bad = Schedule("bad", (1, 1), ((Action("F", 0), Action("SF", 0)), (Action("F", 0),)))
    with pytest.raises(ScheduleError, match="send without a receive"):
        validate(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zigzag", [1, 1], 2)
    with pytest.raises(ValueError, match="straight pipelines only"):
        build_schedule("gpipe", [2, 1], 2)
    with pytest.raises(ValueError, match="split evenly over replicas"):
        build_schedule("pipedream", [2, 1], 3)
    with pytest.raises(ValueError, match="microbatches applies to schedule 'gpipe' or '1f1b-flush'"):
        make("schedule", "pipedream", {"microbatches": 2})
