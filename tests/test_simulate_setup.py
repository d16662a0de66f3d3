"""The simulator's timelines priced with a measured run set-up, and the cost rules they use,
worked out by hand."""
from __future__ import annotations

import dataclasses
import math

import pytest

from handmade import MS, setup, two_layers

from pipetrain import costs
from pipetrain.jsonfile import read_field
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import GPipe, build_schedule
from pipetrain.setup import Setup
from pipetrain.simulate import simulate


def test_a_measured_setup_times_every_action_as_worked_out_by_hand():
    """model-parallel, 2 stages, 1 minibatch. Compute is 2x slower (slowdown 2), a message takes
    1 ms + 1000 B x 1 us/B = 2 ms on the wire and 0.2 ms of each end's CPU (0.4 ms of the sender's time:
    two workers share the one core), an update 0.5 ms x 2."""
    result = simulate(build_schedule("model-parallel", [1, 1], 1), two_layers(setup()), [0, 1])
    got = [{a: (round(s / MS, 6), round(e / MS, 6)) for a, s, e in worker} for worker in result.trace]
    by_hand_0 = {"F0": (0, 2), "SF0": (2, 2.4), "RB0": (2.4, 12.8), "B0": (12.8, 16.8), "U0": (16.8, 17.8)}
    by_hand_1 = {"RF0": (0, 4.4), "F0": (4.4, 6.4), "B0": (6.4, 10.4), "SB0": (10.4, 10.8), "U0": (10.8, 11.8)}
    assert got == [by_hand_0, by_hand_1]
    # without a set-up: the layer profile alone, the optimizer step included
    plain = simulate(build_schedule("model-parallel", [1, 1], 1), two_layers(None), [0, 1])
    assert plain.makespan_s == pytest.approx((1 + 1 + 2 + 2 + 0.5) * MS)


def test_a_schedule_of_microbatches_prices_its_stages_from_the_set_ups_step_at_a_microbatch():
    """Both layers (F 1 ms, B 2 ms each at a minibatch of 8 rows), gpipe on 2 stages with 4
    microbatches of 2 rows. The set-up's training step of the whole model at 2 rows took 3 ms all at
    once, against the layers' 6 ms / 4 = 1.5 ms: every stage's compute runs 2x the profile, a
    microbatch's forward 1 ms / 4 x 2 = 0.5 ms and its backward 1 ms, though the set-up's own
    slowdown reads 1. A step of another size (8 rows), or none, leaves the profile's 0.25 and 0.5 ms."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 1000, 400, optimizer_s=0.5 * MS) for i in range(2)]

    def first_forward_and_backward(step_rows: int, step_s: float = 3 * MS) -> tuple[float, float]:
        measured = setup(cores=8, slowdown=1.0, latency_s=0.0, s_per_byte=0.0, message_cpu_s=0.0, step_s=step_s,
                         step_rows=step_rows)
        profile = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=measured)
        times = {a: e - s for a, s, e in simulate(build_schedule(GPipe(microbatches=4), [1, 1], 1), profile, [0, 1]).trace[0]}
        return times["F0.0"], times["B0.0"]

    assert first_forward_and_backward(2) == (pytest.approx(0.5 * MS), pytest.approx(1 * MS))
    assert first_forward_and_backward(8) == first_forward_and_backward(0, 0.0) == \
        (pytest.approx(0.25 * MS), pytest.approx(0.5 * MS))


def test_a_microbatchs_backward_after_the_first_adds_its_gradients_into_grad():
    """gpipe, one stage of both layers (800 parameter bytes), 3 microbatches, slowdown 2: F 2 ms / 3 x 2,
    B 4 ms / 3 x 2; the second and third backward of a minibatch also add 800 B x 1 us/B into .grad
    (0.8 ms x 2); the update (1 ms x 2) clears .grad, so the next minibatch's first backward adds nothing."""
    result = simulate(build_schedule(GPipe(microbatches=3), [1], 2), two_layers(setup(add_s_per_byte=1e-6)), [0])
    f, b, add, u = 4 / 3, 8 / 3, 1.6, 2.0
    by_hand = [f, f, f, b, b + add, b + add, u] * 2
    assert [(e - s) / MS for _, s, e in result.trace[0]] == pytest.approx(by_hand)
    # a set-up saved before it was measured adds nothing, nor does a schedule of whole minibatches
    assert Setup.from_dict({k: v for k, v in dataclasses.asdict(setup()).items() if k != "add_s_per_byte"},
                           read_field).add_s_per_byte == 0.0
    whole = simulate(build_schedule("pipedream", [1], 2), two_layers(setup(add_s_per_byte=1e-6)), [0])
    assert {round((e - s) / MS, 6) for a, s, e in whole.trace[0] if a.startswith("B")} == {8.0}


def test_a_workers_compute_is_slowed_by_the_share_of_the_others_computing_meanwhile():
    """Between alone (1) and the set-up's slowdown of all computing at once, linearly in the share."""
    assert costs.overlap_slowdown(1.5, 0.0) == 1.0
    assert costs.overlap_slowdown(1.5, 1.0) == pytest.approx(1.5)
    assert costs.overlap_slowdown(1.5, 0.5) == pytest.approx(1.25)
    assert costs.overlap_slowdown(1.5, 2.0) == pytest.approx(1.5) and costs.overlap_slowdown(1.5, -1.0) == 1.0


def _no_messages(**changes: float) -> Setup:
    """Two single-thread workers, slowdown 1.5 all at once, messages and copies free."""
    return setup(**{"slowdown": 1.5, "latency_s": 0.0, "s_per_byte": 0.0, "message_cpu_s": 0.0, **changes})


def test_compute_is_slowed_only_while_other_workers_compute_where_each_has_a_core():
    """pipedream, 2 stages, 2 minibatches, F 1 ms and B 2 ms a layer, no optimizer, free messages; 2
    workers on 2 cores, slowdown 1.5. By hand: worker 0's F0 runs alone (0-1 ms); its F1 and worker
    1's F0 together (1-2.5); worker 1's B0 alone (2.5-4.5); then its F1 beside worker 0's B0 (4.5-6),
    and worker 0's B0 beside it and then beside worker 1's B1 throughout (4.5-7.5). Worker 1's B1 of d
    ms shares its first 1.5 ms: d = 2 (1 + 0.5 x 1.5 / d), d = 1 + sqrt(2.5); worker 0's B1 alone after it.
    On one core for both (time slicing), every action takes the whole slowdown."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 1000, 400) for i in range(2)]
    sched = build_schedule("pipedream", [1, 1], 2)

    def timeline(measured: Setup) -> list[dict[str, tuple[float, float]]]:
        result = simulate(sched, Profile(layers, batch_size=1, device="test", setup=measured), [0, 1])
        return [{a: (s / MS, e / MS) for a, s, e in worker if a[0] in "FB"} for worker in result.trace]

    d = 1 + math.sqrt(2.5)
    by_hand = [{"F0": (0, 1), "F1": (1, 2.5), "B0": (4.5, 7.5), "B1": (6 + d, 8 + d)},
               {"F0": (1, 2.5), "B0": (2.5, 4.5), "F1": (4.5, 6), "B1": (6, 6 + d)}]
    got = timeline(_no_messages(cores=2))
    for mine, hand in zip(got, by_hand):
        assert mine.keys() == hand.keys()
        for action, (start, end) in hand.items():
            assert mine[action] == (pytest.approx(start, rel=2e-3), pytest.approx(end, rel=2e-3)), action
    shared = timeline(_no_messages(cores=1))
    assert {round(e - s, 9) for worker in shared for a, (s, e) in worker.items()} == {1.5, 3.0}


def test_a_step_priced_stage_alone_keeps_the_steps_own_part_of_its_slowdown():
    """gpipe, 2 stages, 4 microbatches of 2 rows (F 1 ms, B 2 ms a layer at 8 rows). The set-up's step
    at 2 rows took 3 ms all at once against the layers' 1.5 ms (2x), of which 1.5x is the workers
    computing at once: worker 0's first forward, alone while worker 1 waits for it, takes
    0.25 ms x 2 / 1.5."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 1000, 400) for i in range(2)]
    measured = _no_messages(cores=2, step_s=3 * MS, step_rows=2)
    profile = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=measured)
    times = {a: e - s for a, s, e in simulate(build_schedule(GPipe(microbatches=4), [1, 1], 1), profile, [0, 1]).trace[0]}
    assert times["F0.0"] == pytest.approx(0.25 * MS * 2 / 1.5)


def test_a_messages_latency_follows_how_much_its_two_ends_compute():
    """Idle 1 ms, busy 5 ms: an end computing a share u of the time delays a message as a busy end with
    chance u, so with shares u and v it takes 1 + 4 (1 - (1 - u)(1 - v)) ms."""
    assert costs.busy_latency_s(1 * MS, 5 * MS, (0.0, 0.0)) == pytest.approx(1 * MS)
    assert costs.busy_latency_s(1 * MS, 5 * MS, (1.0, 0.0)) == pytest.approx(5 * MS)
    assert costs.busy_latency_s(1 * MS, 5 * MS, (0.5, 0.5)) == pytest.approx(4 * MS)
    assert costs.busy_latency_s(1 * MS, 5 * MS, (0.2, 0.5)) == pytest.approx(1 * MS + 4 * MS * 0.6)
    assert costs.busy_latency_s(0.0, 5 * MS, (0.0, 0.0)) == 5 * MS  # not measured idle: always busy


def test_the_simulator_prices_each_message_by_how_busy_the_workers_turn_out():
    """model-parallel, 2 stages, 1 minibatch, a core each (no message CPU), no contention, 0 s per byte:
    with a latency L each way, F 1, B 2 and U 0.5 ms on each worker, the makespan is 6.5 ms + 2 L and
    each worker computes 3.5 ms of it. L is where it meets 1 + 4 (1 - (1 - u)^2) ms for u = 3.5 ms over
    the makespan (idle 1 ms, busy 5 ms): solved here by bisection."""
    def gap(latency: float) -> float:
        u = 3.5 / (6.5 + 2 * latency)
        return 1 + 4 * (1 - (1 - u) ** 2) - latency

    lo, hi = 1.0, 5.0
    for _ in range(60):
        lo, hi = ((lo + hi) / 2, hi) if gap((lo + hi) / 2) > 0 else (lo, (lo + hi) / 2)
    measured = setup(cores=8, slowdown=1.0, latency_s=5 * MS, s_per_byte=0.0, idle_latency_s=1 * MS)
    result = simulate(build_schedule("model-parallel", [1, 1], 1), two_layers(measured), [0, 1])
    assert result.makespan_s == pytest.approx((6.5 + 2 * lo) * MS, rel=1e-3)
    # a set-up saved before the idle latency was measured prices every message busy
    old = Setup.from_dict({k: v for k, v in dataclasses.asdict(measured).items() if k != "idle_latency_s"}, read_field)
    busy = simulate(build_schedule("model-parallel", [1, 1], 1), two_layers(old), [0, 1])
    assert old.idle_latency_s == 0.0 and busy.makespan_s == pytest.approx((6.5 + 2 * 5) * MS)


def test_the_message_cpu_counts_only_when_a_worker_has_under_two_cores():
    roomy = simulate(build_schedule("model-parallel", [1, 1], 1), two_layers(setup(cores=8)), [0, 1])
    assert dict((a, e - s) for a, s, e in roomy.trace[0])["SF0"] == 0.0


def test_a_message_end_costs_the_cpu_measured_after_a_training_step_where_the_set_up_has_it():
    """Two workers with a core each (no contention): a send takes its end's CPU from the worker. A
    set-up that measured a message end after a training step at 0.7 ms + 1 ns/B prices the 1000-byte
    activation at 0.7 + 0.001 ms, above the idle line's 0.2 ms; one saved before it was measured keeps
    the idle line."""
    def send_s(measured: Setup) -> float:
        result = simulate(build_schedule("model-parallel", [1, 1], 1), two_layers(measured), [0, 1])
        return dict((a, e - s) for a, s, e in result.trace[0])["SF0"]

    after_step = setup(cores=2, slowdown=1.0, computing_message_cpu_s=0.7 * MS, computing_message_cpu_s_per_byte=1e-9)
    assert send_s(after_step) == pytest.approx(0.7 * MS + 1000 * 1e-9)
    old = Setup.from_dict({k: v for k, v in dataclasses.asdict(after_step).items() if not k.startswith("computing")},
                          read_field)
    assert old.computing_message_cpu_s == 0.0 and send_s(old) == pytest.approx(0.2 * MS)


def test_starting_a_replicated_stages_allreduce_costs_a_message_ends_cpu():
    """The same stage on 2 workers that share one core: its A, which starts the allreduce of the last
    (here the only) bucket, takes a message end's CPU of those 800 bytes (0.2 ms, 0.4 ms of the worker's
    time on half a core), and the allreduce (2 x 0.5 ms + 800 B x 2 us/B) runs after it."""
    measured = setup(slowdown=1.0, allreduce_latency_s=0.5 * MS, ring_s_per_byte=2e-6)
    times = {a: (s, e) for a, s, e in simulate(build_schedule("pipedream", [2], 4), two_layers(measured), [0]).trace[0]}
    assert times["A0"][1] - times["A0"][0] == pytest.approx(0.4 * MS)
    assert times["S0"][1] - times["A0"][1] == pytest.approx(2 * 0.5 * MS + 800 * 2e-6)


def test_building_a_minibatch_is_priced_on_its_first_forward_where_the_runtime_builds_it():
    """The two layers (F 1 ms, B 2 ms, U 0.5 ms each), building a minibatch's inputs 3 ms and its targets
    5 ms. model-parallel on 2 stages: stage 0's forward also builds the inputs (1 + 3 ms), stage 1's the
    targets (1 + 5 ms): 4 + 6 + 2 + 2 + 0.5 = 14.5 ms, 8 ms more than the layers alone. gpipe with 2
    microbatches builds once per minibatch, on its first microbatch's forward (0.5 + 3, then 0.5)."""
    built = dataclasses.replace(two_layers(None), inputs_s=3 * MS, targets_s=5 * MS)
    result = simulate(build_schedule("model-parallel", [1, 1], 1), built, [0, 1])
    times = [{a: (round(s / MS, 6), round(e / MS, 6)) for a, s, e in worker} for worker in result.trace]
    assert times[0]["F0"] == (0, 4) and times[1]["F0"] == (4, 10)
    assert result.makespan_s == pytest.approx(14.5 * MS)
    gpipe = simulate(build_schedule(GPipe(microbatches=2), [1, 1], 1), built, [0, 1]).trace[0]
    assert [round((e - s) / MS, 6) for a, s, e in gpipe if a.startswith("F")] == [3.5, 0.5]


def test_a_one_stage_pipeline_computes_as_long_as_the_setups_step_at_the_whole_minibatch():
    """The same two layers (4 ms forward, 40 ms backward, 2 ms of optimizer on the batch of 32) as one
    stage on one worker. The set-up timed a training step of all 32 rows at 66 ms with every worker
    computing: 1.5x the profile's 44 ms. So an iteration is 6 + 60 ms and the update at the set-up's
    slowdown (2 x 2 ms): 70 ms. A step of 16 rows says nothing of a whole minibatch: the slowdown
    prices it all, 88 + 4 ms. Data parallelism's shards (2 x 16 rows) are not this case."""
    layers = [LayerProfile(str(i), 2 * MS, 20 * MS, 1000, 4000, optimizer_s=1 * MS) for i in range(2)]

    def rate(rows: int) -> float:
        measured = setup(cores=8, slowdown=2.0, step_s=66 * MS, step_rows=rows)
        profile = Profile(layers, batch_size=32, device="test", input_bytes=1000, setup=measured)
        return simulate(build_schedule("pipedream", [1], 6), profile, [0]).samples_per_s

    assert rate(32) == pytest.approx(32 / (70 * MS))
    assert rate(16) == pytest.approx(32 / (92 * MS))
    # building a minibatch (3 ms of inputs, 1 ms of targets) is not the step: it keeps the slowdown, 2 x 4 ms
    measured = setup(cores=8, slowdown=2.0, step_s=66 * MS, step_rows=32)
    built = Profile(layers, batch_size=32, device="test", input_bytes=1000, setup=measured, inputs_s=3 * MS,
                    targets_s=1 * MS)
    assert simulate(build_schedule("pipedream", [1], 6), built, [0]).samples_per_s == pytest.approx(32 / (78 * MS))
    # building both at once (one fetch per item) timed at 2.5 ms: a worker that is every stage takes that, 2 x 2.5
    once = dataclasses.replace(built, both_s=2.5 * MS)
    assert simulate(build_schedule("pipedream", [1], 6), once, [0]).samples_per_s == pytest.approx(32 / (75 * MS))


def test_a_one_stage_schedule_of_microbatches_computes_as_long_as_the_setups_step_at_a_microbatch():
    """The same layers as one gpipe stage on one worker, 4 microbatches of 8 rows (what ``stages="auto"``
    plans for one worker). The set-up timed a training step of 8 rows, a microbatch, at 16.5 ms: 1.5x
    the profile's 44 ms / 4. So a microbatch's forward takes 1 ms x 1.5 and its backward 10 ms x 1.5,
    and the update keeps the set-up's slowdown (2 x 2 ms): 4 x 16.5 + 4 = 70 ms a minibatch. A step of
    the whole minibatch (32 rows) is not what a microbatch runs: the slowdown prices it all, 88 + 4 ms."""
    layers = [LayerProfile(str(i), 2 * MS, 20 * MS, 1000, 4000, optimizer_s=1 * MS) for i in range(2)]

    def rate(rows: int, step_s: float) -> float:
        measured = setup(cores=8, slowdown=2.0, step_s=step_s, step_rows=rows)
        profile = Profile(layers, batch_size=32, device="test", input_bytes=1000, setup=measured)
        return simulate(build_schedule(GPipe(microbatches=4), [1], 6), profile, [0]).samples_per_s

    assert rate(8, 16.5 * MS) == pytest.approx(32 / (70 * MS))
    assert rate(32, 66 * MS) == pytest.approx(32 / (92 * MS))


def test_the_last_of_several_workers_arrives_as_order_statistics_say():
    """Work of 10 ms with a jitter of 0.1 ms per second of it varies by σ = 1 ms. Two workers due
    together: the later comes σ/sqrt(π) late; three: 3σ/(2 sqrt(π)); four: 1.0294σ. Due δ apart, the
    later of N(0, σ²) and N(δ, σ²) comes at δ Φ(δ/θ) + θ φ(δ/θ), θ = σ sqrt(2)."""
    sigma, work, jitter = 1 * MS, 10 * MS, 1e-4
    assert costs.last_arrival_s([5 * MS, 5 * MS], work, jitter) == pytest.approx(5 * MS + sigma / math.sqrt(math.pi),
                                                                                 rel=1e-4)
    assert costs.last_arrival_s([0.0] * 3, work, jitter) == pytest.approx(3 * sigma / (2 * math.sqrt(math.pi)), rel=1e-4)
    assert costs.straggler_s(work, jitter, 4) == pytest.approx(1.029375 * sigma, rel=1e-4)
    assert costs.straggler_s(work, jitter, 1) == 0.0
    theta = sigma * math.sqrt(2)
    for delta in (0.5 * MS, 2 * MS, 6 * MS):
        z = delta / theta
        by_hand = delta * 0.5 * (1 + math.erf(z / math.sqrt(2))) + theta * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
        assert costs.last_arrival_s([0.0, delta], work, jitter) == pytest.approx(by_hand, rel=1e-4)
    assert costs.last_arrival_s([0.0, 3 * MS], work, 0.0) == 3 * MS


def test_a_replicated_stage_waits_for_its_slowest_replica():
    """The stage of two_layers (6 ms of forward and backward) on 2 workers with a jitter of 1.5 ms per
    second: σ = 3 ms, and the replicas start their first allreduce together as simulated, so it begins
    σ/sqrt(π) after that; the allreduce itself (2 x 0.5 ms + 800 B x 2 us/B) follows."""
    measured = setup(cores=8, slowdown=1.0, allreduce_latency_s=0.5 * MS, ring_s_per_byte=2e-6, jitter_s=1.5 * MS)
    times = {a: (s, e) for a, s, e in simulate(build_schedule("pipedream", [2], 4), two_layers(measured), [0]).trace[0]}
    late = 3 * MS / math.sqrt(math.pi)
    assert times["S0"][1] - times["A0"][1] == pytest.approx(late + 2 * 0.5 * MS + 800 * 2e-6, rel=1e-4)
