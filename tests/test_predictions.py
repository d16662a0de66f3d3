"""Predictions from a profile with the optimizer step and a measured run set-up, and strategy="auto"."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pt_models import Spell

import pipetrain
from pipetrain import costs
from pipetrain.planning import Plan, StagePlan, plan
from pipetrain.planning.choose import choose_strategy
from pipetrain.jsonfile import read_field
from pipetrain.predict import predict_cgdp, predict_data_parallel
from pipetrain.predict.pipeline import predict_plan
from pipetrain.profiling import LayerProfile, Profile, as_minibatch, profile_model
from pipetrain.registry import GPipe, PipeDream, build_schedule
from pipetrain.setup import Setup, measure_setup, model_step
from pipetrain.setup.collectives import STAGGER_S, staggered_calls
from pipetrain.setup.compute import SETTLE_EXCESS, jitter_of_calls
from pipetrain.setup.messages import COMPUTING_ROUNDS_SECONDS, computing_rounds
from pipetrain.simulate import Link, simulate

MS = 1e-3


def setup(**changes: float) -> Setup:
    """One core for two single-thread workers: every message end's CPU comes out of the compute."""
    fields = dict(backend="gloo", workers=2, threads=1, cores=1, slowdown=2.0, latency_s=1 * MS, s_per_byte=1e-6,
                  message_cpu_s=0.2 * MS, message_cpu_s_per_byte=0.0, copy_s_per_byte=0.0)
    return Setup(**{**fields, **changes})  # type: ignore[arg-type]


def two_layers(with_setup: Setup | None) -> Profile:
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 1000, 400, optimizer_s=0.5 * MS) for i in range(2)]
    return Profile(layers, batch_size=1, device="test", input_bytes=10, setup=with_setup)


DDP = {"buckets_in_backward": True}
"""How ddp synchronizes: the backend's allreduce, its buckets inside the backward, K = 1."""
PIPE_SGD = {"staleness": 2, "own_ring": True}
"""How pipe-sgd synchronizes by default: our own ring, K = 2."""


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


def _burn_20ms() -> None:
    end = time.thread_time() + 0.02
    while time.thread_time() < end:
        pass


@pytest.mark.multiprocess
def test_the_probe_leaves_the_training_steps_own_cpu_out_of_a_message_after_it():
    """A kernel that burns 20 ms of CPU in its own thread: were it counted, a message end after it
    would read 10 ms or more (one kernel per round trip of two ends); it reads what the transport
    costs. Long steps get fewer round trips: at most COMPUTING_ROUNDS_SECONDS in all, at least 3."""
    measured = measure_setup(2, 1, _burn_20ms, seconds=0.05, rounds=3, compute_rounds=1, ring_cpu=False)
    assert 0 < measured.computing_message_cpu_s + 1e6 * measured.computing_message_cpu_s_per_byte < 5 * MS
    assert computing_rounds(1 * MS, 20) == 20
    assert computing_rounds(0.1, 20) == int(COMPUTING_ROUNDS_SECONDS / 0.2)
    assert computing_rounds(5.0, 20) == 3


def test_gradient_allreduces_are_priced_with_the_measured_allreduces_not_the_message_line():
    """One stage of 800 parameter bytes on 2 workers. One allreduce of n bytes over p = 2 takes
    2 (p-1) α + 2 (p-1)/p n β, with the measured ring's β = 2 us/B and the α of what runs it: our ring's
    3 ms for pipe-sgd (7.6 ms), the backend's all_reduce's 0.5 ms for ddp and a replicated stage's
    sync (2.6 ms), not the message line's 1 ms and 1 us/B (2.8 ms)."""
    measured = setup(cores=8, slowdown=1.0, ring_latency_s=3 * MS, ring_s_per_byte=2e-6, allreduce_latency_s=0.5 * MS)
    profile = two_layers(measured)
    ours, backend = 2 * 3 * MS + 800 * 2e-6, 2 * 0.5 * MS + 800 * 2e-6
    times = {a: (s, e) for a, s, e in simulate(build_schedule("pipedream", [2], 4), profile, [0]).trace[0]}
    assert times["S0"][1] - times["A0"][0] == pytest.approx(backend)  # both layers' 400 bytes: one bucket
    assert predict_data_parallel(profile, 2, Link(), **PIPE_SGD, reduce_s=0.0).comm_s == pytest.approx(ours)
    assert predict_data_parallel(profile, 2, Link(), **DDP, reduce_s=0.0).comm_s == pytest.approx(backend)
    without = predict_data_parallel(two_layers(setup(cores=8, slowdown=1.0)), 2, Link(), **PIPE_SGD, reduce_s=0.0)
    assert without.comm_s == pytest.approx(2 * 1 * MS + 800 * 1e-6)


def test_a_gradient_of_one_probed_bucket_moves_at_the_backends_own_rate_at_sync_a_larger_at_the_busy_rings():
    """The set-up probed the backend's all_reduce at sync at 800 bytes: 5 us/B beside its 0.5 ms α. The
    two layers' 800 bytes (one bucket, allreduced after the backward) then take 2 x 0.5 ms + 800 x 5 us
    = 5 ms, for a replicated stage and for ddp; our ring (pipe-sgd) keeps its own line (7.6 ms). Probed
    at 400 bytes only, the 800-byte gradient is larger than what was probed, and its buckets would
    mostly move while the backward computes: the busy ring's 2 us/B prices it, 2.6 ms."""
    probed = setup(cores=8, slowdown=1.0, ring_latency_s=3 * MS, ring_s_per_byte=2e-6, allreduce_latency_s=0.5 * MS,
                   allreduce_s_per_byte=5e-6, allreduce_bytes=800)
    at_sync, ours = 2 * 0.5 * MS + 800 * 5e-6, 2 * 3 * MS + 800 * 2e-6
    times = {a: (s, e) for a, s, e in simulate(build_schedule("pipedream", [2], 4), two_layers(probed), [0]).trace[0]}
    assert times["S0"][1] - times["A0"][0] == pytest.approx(at_sync)
    assert predict_data_parallel(two_layers(probed), 2, Link(), **DDP, reduce_s=0.0).comm_s == pytest.approx(at_sync)
    assert predict_data_parallel(two_layers(probed), 2, Link(), **PIPE_SGD, reduce_s=0.0).comm_s == pytest.approx(ours)
    smaller = two_layers(dataclasses.replace(probed, allreduce_bytes=400))
    busy = 2 * 0.5 * MS + 800 * 2e-6
    assert predict_data_parallel(smaller, 2, Link(), **DDP, reduce_s=0.0).comm_s == pytest.approx(busy)


def test_our_ring_moves_at_the_busy_rate_while_the_workers_compute_beside_it_and_at_the_idle_rate_after():
    """Both layers' 800 parameter bytes on 2 workers. Our ring measured busy, 3 ms a step + 2 us/B, takes
    2 x 3 + 800 x 2 us = 7.6 ms; idle, 1 ms + 1 us/B, 2.8 ms. Pipe-sgd (K = 2) computes beside it for its
    update (2 x 0.5 ms) and its half of the forward and backward (6 ms / 2): 4 ms at the busy rate move
    4 / 7.6 of the ring, the rest takes (1 - 4 / 7.6) x 2.8 ms. K = 1 waits for the ring: all idle. A
    caller's 5 ms update computes beyond the busy ring's 7.6 ms: all busy. DDP, and a set-up saved
    before the idle ring was measured, are priced as before. Where the set-up timed the job's own ring
    idle (3.5 ms for these 800 bytes on 2 workers), that stands for the idle line, but no faster than
    the link: at 200 KB/s its 800 bytes take 4 ms, and busy 2 x 3 + 800 x 5 us = 10 ms."""
    busy, idle = 7.6 * MS, 2.8 * MS
    measured = setup(cores=8, slowdown=1.0, ring_latency_s=3 * MS, ring_s_per_byte=2e-6, allreduce_latency_s=0.5 * MS,
                     idle_ring_latency_s=1 * MS, idle_ring_s_per_byte=1e-6)

    def comm_s(profile: Profile, flags: dict[str, object] = PIPE_SGD, **options: float) -> float:
        return predict_data_parallel(profile, 2, Link(), reduce_s=0.0, **{**flags, **options}).comm_s  # type: ignore[arg-type]

    assert comm_s(two_layers(measured)) == pytest.approx(4 * MS + (1 - 4 / 7.6) * idle)
    assert comm_s(two_layers(measured), staleness=1) == pytest.approx(idle)
    assert comm_s(two_layers(measured), update_s=5 * MS) == pytest.approx(busy)
    assert comm_s(two_layers(measured), DDP) == pytest.approx(2 * 0.5 * MS + 800 * 2e-6)
    old = Setup.from_dict({k: v for k, v in dataclasses.asdict(measured).items() if not k.startswith("idle_ring")},
                          read_field)
    assert comm_s(two_layers(old)) == pytest.approx(busy)
    timed = dataclasses.replace(measured, idle_ring_s={"none": 3.5 * MS}, ring_cpu_bytes=800)
    assert comm_s(two_layers(timed)) == pytest.approx(3.5 * MS + 4 * MS * (1 - 3.5 / 7.6))
    slow = predict_data_parallel(two_layers(timed), 2, Link(2e5), **PIPE_SGD, reduce_s=0.0).comm_s
    assert slow == pytest.approx(4 * MS + 4 * MS * (1 - 4 / 10))
    assert comm_s(two_layers(dataclasses.replace(timed, ring_cpu_bytes=1600))) == \
        pytest.approx(4 * MS + (1 - 4 / 7.6) * idle)  # timed at another gradient: the line
    # the rule alone: a ring measured slower idle than busy (noise) is priced busy
    assert costs.overlapped_ring_s(1.0, 5.0, 2.0) == pytest.approx(1.0 + 2.0 * 0.8)
    assert costs.overlapped_ring_s(6.0, 5.0, 2.0) == costs.overlapped_ring_s(0.0, 5.0, 2.0) == 5.0


def test_pipe_sgds_mean_is_one_pass_over_the_gradient_after_its_ring():
    """Both layers' 800 parameter bytes on 2 workers; an add costs 1 us/B. Pipe-sgd's thread divides the
    ring's sum by p: 0.8 ms, 1.6 ms at slowdown 2, after the ring of 2 x 3 ms + 800 x 2 us/B. With 4
    workers on 4 cores its 0.8 ms of CPU joins the ring's 7.2 ms on the compute side (update 2 x 0.5 ms).
    DDP's backend divides inside its allreduce: nothing is added to it."""
    measured = setup(cores=8, ring_latency_s=3 * MS, ring_s_per_byte=2e-6, allreduce_latency_s=0.5 * MS,
                     add_s_per_byte=1e-6)
    assert predict_data_parallel(two_layers(measured), 2, Link(), **PIPE_SGD, reduce_s=0.0).comm_s == \
        pytest.approx(2 * 3 * MS + 800 * 2e-6 + 2 * 0.8 * MS)
    assert predict_data_parallel(two_layers(measured), 2, Link(), **DDP, reduce_s=0.0).comm_s == \
        pytest.approx(2 * 0.5 * MS + 800 * 2e-6)
    shared = setup(workers=4, cores=4, ring_cpu_s=1 * MS, ring_cpu_s_per_byte=1e-6, add_s_per_byte=1e-6)
    assert predict_data_parallel(two_layers(shared), 4, Link(), **PIPE_SGD, reduce_s=0.0).update_s == \
        pytest.approx(2 * MS + 7.2 * MS + 0.8 * MS)


def test_pipe_sgd_charges_the_rings_measured_cpu_spread_over_the_shared_cores():
    """Both layers (800 parameter bytes) on 4 workers: a ring block of 200 B. The measured ring costs
    1 ms + 1 us/B of CPU per step, so one allreduce 2 (4-1) (1 + 0.2) = 7.2 ms. Compute and the
    update (2 x 0.5 ms) run 2x slower all at once. With half a core each, the ring's CPU costs a worker
    twice its time; with one, its time; with two, nothing; a set-up saved before the ring's CPU was
    measured prices a send and a receive of the block per step (2 x 6 x 0.2 ms), and the adds. Where
    compute all at once runs 3x slower on those half cores, the ring's CPU and the update do too."""
    def step_s(**changes: float) -> float:
        measured = setup(**{"workers": 4, "ring_cpu_s": 1 * MS, "ring_cpu_s_per_byte": 1e-6, **changes})
        return predict_data_parallel(two_layers(measured), 4, Link(), **PIPE_SGD, reduce_s=0.0).update_s

    assert step_s(cores=2) == pytest.approx(2 * MS + 2 * 7.2 * MS)
    assert step_s(cores=2, slowdown=3.0) == pytest.approx(3 * MS + 3 * 7.2 * MS)
    assert step_s(cores=4) == pytest.approx(2 * MS + 7.2 * MS)
    assert step_s(cores=8) == pytest.approx(2 * MS)
    # ... and the ring's adds apart, timed here: microseconds for 50 floats
    assert step_s(cores=4, ring_cpu_s=0.0) == pytest.approx(2 * MS + 2 * 6 * 0.2 * MS, abs=0.05 * MS)


def test_where_workers_share_cores_pipe_sgd_is_priced_from_its_loop_as_the_set_up_timed_it():
    """Both layers' 800 parameter bytes on 4 workers on 2 cores, compute 2x slower all at once. The set-up
    timed pipe-sgd's loop (a step, the ring of the one before beside it) at those 800 bytes: 20 ms an
    iteration plain, 12 ms with quant8. The update (2 x 0.5 ms, 2x: 2 ms), the copy of the gradient out
    of .grad (800 B x 1 us/B, 2x: 1.6 ms) and the mean (800 B x 0.5 us/B, 2x: 0.8 ms) share the cores:
    an iteration takes 20 + 2 + 1.6 + 0.8 = 24.4 ms, and the ring's CPU is charged nowhere else (the
    compute side is the update and the copy). At 1 KB/s the link alone moves the plain ring's
    2 x 3/4 x 800 B in 1.2 s: that instead. K = 1, a loop timed for another gradient, and a caller's
    cores per worker are priced as without the timing."""
    timed = setup(workers=4, cores=2, copy_s_per_byte=1e-6, add_s_per_byte=0.5e-6, ring_cpu_s=1 * MS,
                  ring_cpu_s_per_byte=1e-6, ring_cpu_bytes=800, period_s={"none": 20 * MS, "quant8": 12 * MS})

    def predict(measured: Setup, link: Link = Link(), **options: object) -> object:
        return predict_data_parallel(two_layers(measured), 4, link, reduce_s=0.0, **{**PIPE_SGD, **options})  # type: ignore[arg-type]

    plain = predict(timed)
    assert (plain.comm_s, plain.update_s, plain.bound) == (pytest.approx(24.4 * MS), pytest.approx(3.6 * MS),
                                                           "communication")
    assert plain.formula_samples_per_s == pytest.approx(1 / (24.4 * MS))
    assert predict(timed, compression="quant8").comm_s == pytest.approx(16.4 * MS)
    assert predict(timed, Link(1e3)).comm_s == pytest.approx(1.2)
    untimed = dataclasses.replace(timed, period_s={})
    for options in ({"staleness": 1}, {"cores_per_worker": 0.5}):
        assert predict(timed, **options).comm_s == pytest.approx(predict(untimed, **options).comm_s)
        assert predict(timed, **options).update_s == pytest.approx(predict(untimed, **options).update_s)
    other = dataclasses.replace(timed, ring_cpu_bytes=1600)
    assert (predict(other).comm_s, predict(other).update_s) == \
        (pytest.approx(predict(untimed).comm_s), pytest.approx(predict(untimed).update_s))
    assert predict(untimed).update_s > 3.6 * MS + 2 * 7.2 * MS  # the ring's CPU charged to the compute side
    assert costs.shared_core_period_s(20 * MS, 3 * MS, 1 * MS, 5 * MS) == pytest.approx(24 * MS)
    assert costs.shared_core_period_s(20 * MS, 3 * MS, 1 * MS, 30 * MS) == pytest.approx(30 * MS)


def test_a_codecs_ring_is_charged_the_cpu_the_set_up_measured_for_it_at_the_jobs_gradient():
    """Both layers' 800 parameter bytes on 4 workers with one core each: quant8's ring measured at
    those 800 bytes costs 5 ms of CPU, and the mean after it 800 B x 1 us/B. The compute side is the
    update (2 x 0.5 ms) and that CPU. Measured at another gradient or for other workers, the plain
    ring's line at quant8's blocks (4 x 1028 B: one 1024-element granule each) stands in, plus the
    codec's arithmetic timed here (well under a millisecond for 1024 floats)."""
    def step_s(workers: int = 4, nbytes: int = 800) -> float:
        measured = setup(workers=workers, cores=workers, ring_cpu_s=1 * MS, ring_cpu_s_per_byte=1e-6,
                         add_s_per_byte=1e-6, codec_ring_cpu_s={"quant8": 5 * MS}, ring_cpu_bytes=nbytes)
        return predict_data_parallel(two_layers(measured), 4, Link(), **PIPE_SGD, compression="quant8",
                                     reduce_s=0.0).update_s

    assert step_s() == pytest.approx(2 * MS + 5 * MS + 0.8 * MS)
    line = 2 * 3 * (1 * MS + 1028 * 1e-6)
    for other in (step_s(nbytes=1600), step_s(workers=2)):
        assert 2 * MS + line + 0.8 * MS < other < 2 * MS + line + 0.8 * MS + 2 * MS


def test_a_setups_codec_cpu_must_be_numbers_by_codec():
    fields = dataclasses.asdict(setup(codec_ring_cpu_s={"quant8": 5 * MS}, ring_cpu_bytes=800))
    assert Setup.from_dict(fields, read_field).codec_ring_cpu("quant8", 2, 800) == 5 * MS
    with pytest.raises(ValueError, match=r"setup.codec_ring_cpu_s: 'quant8' is -1"):
        Setup.from_dict({**fields, "codec_ring_cpu_s": {"quant8": -1}}, read_field)
    with pytest.raises(ValueError, match=r"'setup.codec_ring_cpu_s' is 3, not an object"):
        Setup.from_dict({**fields, "codec_ring_cpu_s": 3}, read_field)
    with pytest.raises(ValueError, match=r"'setup.idle_ring_s' is 3, not an object"):
        Setup.from_dict({**fields, "idle_ring_s": 3}, read_field)
    assert Setup.from_dict({**fields, "idle_ring_s": {"none": 0.01}}, read_field).idle_ring("none", 2, 800) == 0.01


def test_starting_a_replicated_stages_allreduce_costs_a_message_ends_cpu():
    """The same stage on 2 workers that share one core: its A, which starts the allreduce of the last
    (here the only) bucket, takes a message end's CPU of those 800 bytes (0.2 ms, 0.4 ms of the worker's
    time on half a core), and the allreduce (2 x 0.5 ms + 800 B x 2 us/B) runs after it."""
    measured = setup(slowdown=1.0, allreduce_latency_s=0.5 * MS, ring_s_per_byte=2e-6)
    times = {a: (s, e) for a, s, e in simulate(build_schedule("pipedream", [2], 4), two_layers(measured), [0]).trace[0]}
    assert times["A0"][1] - times["A0"][0] == pytest.approx(0.4 * MS)
    assert times["S0"][1] - times["A0"][1] == pytest.approx(2 * 0.5 * MS + 800 * 2e-6)


def test_ddp_waits_only_for_the_allreduces_its_backward_did_not_hide():
    """Two layers of 2 MiB of weights, 20 ms of backward each on the whole batch (10 ms on each of 2
    workers' halves). DDP's first bucket (1 MiB cap) is the last layer's gradient, ready at 10 ms; the
    second the first layer's, ready at 20 ms. Each allreduce: 2 x 1 ms + 2 MiB x 5 ns/B = 12.49 ms, one
    at a time: the first ends at 22.49 ms, the second at 34.97 ms, 14.97 ms after the backward (not
    24.97, the two allreduces after it)."""
    mib2 = 2 << 20
    layers = [LayerProfile(str(i), 2 * MS, 20 * MS, 1000, mib2) for i in range(2)]
    measured = setup(cores=8, slowdown=1.0, ring_s_per_byte=5e-9, allreduce_latency_s=1 * MS)
    profile = Profile(layers, batch_size=32, device="test", input_bytes=1000, setup=measured)
    ddp = predict_data_parallel(profile, 2, Link(), **DDP, reduce_s=0.0)
    allreduce = 2 * MS + mib2 * 5e-9
    assert ddp.comm_s == pytest.approx(2 * MS + 2 * mib2 * 5e-9)  # the whole gradient at once
    waited = 10 * MS + 2 * allreduce - 20 * MS
    iteration = 2 * MS + 20 * MS + waited  # forward, backward, then the wait; no optimizer time
    assert ddp.formula_samples_per_s == pytest.approx(32 / iteration)
    assert ddp.samples_per_s == pytest.approx(32 / iteration)


def test_a_data_parallel_worker_computes_as_long_as_the_setups_step_at_its_shard():
    """The two layers above (2 ms forward, 20 ms backward, 2 MiB, 1 ms optimizer each, batch 32) on 2
    workers: the profile's share is (4 + 40) / 2 = 22 ms. The set-up timed a training step of 16 rows,
    a worker's shard, at 33 ms with both workers computing: 1.5x the share. So a worker's forward takes
    3 ms and each layer's backward 15 ms: buckets ready at 15 and 30 ms, allreduced 15-27.49 and
    30-42.49 ms, 12.49 ms waited; the update keeps the set-up's slowdown (2 x 2 x 1 ms). A step of
    another batch (8 rows) says nothing of the shard: the slowdown prices it all, as before."""
    mib2 = 2 << 20
    layers = [LayerProfile(str(i), 2 * MS, 20 * MS, 1000, mib2, optimizer_s=1 * MS) for i in range(2)]

    def profile(rows: int) -> Profile:
        measured = setup(cores=8, slowdown=2.0, ring_s_per_byte=5e-9, allreduce_latency_s=1 * MS, step_s=33 * MS,
                         step_rows=rows)
        return Profile(layers, batch_size=32, device="test", input_bytes=1000, setup=measured)

    allreduce = 2 * MS + mib2 * 5e-9
    ddp = predict_data_parallel(profile(16), 2, Link(), **DDP, reduce_s=0.0)
    assert ddp.compute_s == pytest.approx(33 * MS)
    assert ddp.samples_per_s == pytest.approx(32 / (3 * MS + 30 * MS + (30 * MS + allreduce - 30 * MS) + 4 * MS))
    assert predict_cgdp(profile(16), 2, 1).iteration_s == pytest.approx(3 * MS + 30 * MS + 4 * MS)
    other = predict_data_parallel(profile(8), 2, Link(), **DDP, reduce_s=0.0)
    assert other.compute_s == pytest.approx(2 * 22 * MS)
    assert other.samples_per_s == pytest.approx(32 / (4 * MS + 40 * MS + allreduce + 4 * MS))


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


def test_a_data_parallel_worker_builds_its_shard_at_the_setups_slowdown_not_the_steps():
    """The set-up above (a step of 16 rows 1.5x the profile's share, slowdown 2) and building a
    minibatch's inputs 4 ms and targets 2 ms: each of 2 workers builds its half of both, 3 ms, at the
    set-up's slowdown (not the step's, which measured the model, not the data): 6 ms more per
    iteration, in ddp's compute and its rate, and in cgdp's iteration."""
    mib2 = 2 << 20
    layers = [LayerProfile(str(i), 2 * MS, 20 * MS, 1000, mib2, optimizer_s=1 * MS) for i in range(2)]
    measured = setup(cores=8, slowdown=2.0, ring_s_per_byte=5e-9, allreduce_latency_s=1 * MS, step_s=33 * MS,
                     step_rows=16)
    profile = Profile(layers, batch_size=32, device="test", input_bytes=1000, setup=measured, inputs_s=4 * MS,
                      targets_s=2 * MS)
    allreduce = 2 * MS + mib2 * 5e-9
    ddp = predict_data_parallel(profile, 2, Link(), **DDP, reduce_s=0.0)
    assert ddp.compute_s == pytest.approx(33 * MS + 6 * MS)
    iteration = 6 * MS + 3 * MS + 30 * MS + allreduce + 4 * MS  # build, forward, backward, the wait, update
    assert ddp.samples_per_s == pytest.approx(32 / iteration)
    assert ddp.formula_samples_per_s == pytest.approx(32 / iteration)
    assert predict_cgdp(profile, 2, 1).iteration_s == pytest.approx(6 * MS + 3 * MS + 30 * MS + 4 * MS)


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


def test_what_a_prediction_times_here_it_times_with_the_workers_thread_count(monkeypatch: pytest.MonkeyPatch):
    """The codec's arithmetic (pipe-sgd) and the host's copy and add (cgdp) are timed in this process,
    as a worker with the set-up's thread count runs them (vgg-like's trunc16 ring: 19 ms of arithmetic
    with this VM's 2 threads, 30-42 ms with the workers' 1); this process's own count comes back."""
    import pipetrain.strategies.cgdp as cgdp_module
    import pipetrain.strategies.ring as ring_module

    seen: list[int] = []
    monkeypatch.setattr(ring_module, "ring_compute_seconds", lambda *a, **k: seen.append(torch.get_num_threads()) or 1e-3)
    monkeypatch.setattr(cgdp_module, "measure_host_costs", lambda *a, **k: seen.append(torch.get_num_threads())
                        or {"copy_s_per_byte": 1e-10, "sum_s_per_byte": 1e-10})
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        measured = two_layers(setup(threads=2, cores=8, workers=2))
        predict_data_parallel(measured, 2, Link(), **PIPE_SGD, compression="quant8")
        choose_strategy(measured, 2, batch_size=2, strategies=["cgdp"])
        assert seen == [2, 2, 2] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.multiprocess
def test_a_model_step_counts_its_rows_and_the_probe_times_it_with_every_worker():
    net = nn.Linear(4, 2)
    assert model_step(net, ((torch.zeros(5, 4), torch.zeros(5, 1)), torch.zeros(5, 2)), nn.functional.mse_loss).rows == 5
    measured = measure_setup(2, 1, model_step(net, (torch.randn(3, 4), torch.randn(3, 2)), nn.functional.mse_loss),
                             seconds=0.05, rounds=3, compute_rounds=1, ring_bytes=40)
    assert measured.step_rows == 3 and 0 < measured.step_s < 0.05 and "a training step of 3 rows" in measured.describe()
    assert Setup.from_dict(dataclasses.asdict(measured), read_field) == measured
    # its 40 B of gradient are below the rings the probe times: no codec's ring is measured at them
    assert measured.codec_ring_cpu_s == {} and measured.codec_ring_cpu("quant8", 2, 40) is None


@pytest.mark.multiprocess
def test_a_set_up_samples_compute_again_while_the_machine_takes_cores_and_keeps_a_load_that_stays():
    """Two workers with a core each explain a slowdown of 1. Rank 1 computing 3x slower (15 ms a call
    against 5) reads 2: rounds go on until the median of the last three reads within 1.5x of what the
    cores explain (those are kept: one may be the round the spell ended in, read anywhere between), or
    for ``settle_s`` (every round is kept; a step is the mean of the calls, and rank 0 makes three for
    each of rank 1's: 7.5 ms in the spell)."""
    spell = measure_setup(2, 1, Spell(0.005, 3.0, 1.0), seconds=0.05, rounds=3, ring_bytes=40, settle_s=10.0)
    assert spell.slowdown < SETTLE_EXCESS and spell.step_s < 0.007
    stays = measure_setup(2, 1, Spell(0.005, 3.0, math.inf), seconds=0.05, rounds=3, ring_bytes=40, settle_s=1.0)
    assert stays.slowdown == pytest.approx(2.0, rel=0.15) and stays.step_s > 0.0065
    steady = measure_setup(2, 1, Spell(0.005, 1.0, 0.0), seconds=0.05, rounds=3, ring_bytes=40)
    assert steady.slowdown < 1.2


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


def test_the_planner_stops_replicating_when_replicas_straggle():
    """Layers of 3 ms and 6 ms (forward + backward): replicated on 2 workers a minibatch takes 9/2 ms,
    as a pipeline the slower stage's 6 ms. With a jitter of 4 ms per second, the replicas' 9 ms vary by
    σ = 6 ms and the later one comes 0.5642σ = 3.4 ms late: (9 + 3.4)/2 = 6.2 ms, and the pipeline wins."""
    layers = [LayerProfile("0", 1 * MS, 2 * MS, 10, 100), LayerProfile("1", 2 * MS, 4 * MS, 10, 100)]
    steady = setup(cores=8, slowdown=1.0, latency_s=0.0)
    for jitter, replicas in ((0.0, [2]), (4 * MS, [1, 1])):
        profile = Profile(layers, batch_size=8, device="test", input_bytes=10,
                          setup=dataclasses.replace(steady, jitter_s=jitter))
        assert plan(profile, 2, "100Gbit").replicas == replicas


def test_the_probes_jitter_is_the_variance_of_every_workers_calls_per_second():
    """Calls of 1 and 3 ms on one worker, 2 and 2 ms on another: mean 2 ms, variance 0.5 ms², 0.25 ms per
    second of compute."""
    assert jitter_of_calls([[1 * MS, 3 * MS], [2 * MS, 2 * MS]]) == pytest.approx(0.25 * MS)
    assert jitter_of_calls([[2 * MS]]) == 0.0


def test_a_setup_saved_with_a_key_no_longer_measured_loads_without_it():
    """A profile saved by an older version may hold set-up keys that are no field any more."""
    saved = two_layers(setup(jitter_s=1e-4)).to_dict()
    saved["setup"]["resampled_s"] = 1.5
    assert Profile.from_dict(json.loads(json.dumps(saved))).setup == setup(jitter_s=1e-4)


def test_a_setup_saved_before_the_allreduces_were_measured_loads_and_prices_with_messages():
    fields = {k: v for k, v in dataclasses.asdict(setup()).items() if "ring" not in k and "allreduce" not in k}
    old = Setup.from_dict(fields, read_field)
    assert (old.ring_latency_s, old.ring_s_per_byte, old.allreduce_latency_s, old.allreduce_cpu_s,
            old.ring_cpu_s, old.ring_cpu_s_per_byte, old.idle_ring_latency_s, old.idle_ring_s_per_byte) == (0.0,) * 8
    assert old.codec_ring_cpu_s == {} and old.codec_ring_cpu("quant8", 2, 0) is None
    assert old.allreduce_terms(ours=True) == old.allreduce_terms(ours=False) == (old.latency_s, old.s_per_byte)
    ring_only = dataclasses.replace(old, ring_s_per_byte=2e-9, allreduce_latency_s=1 * MS)
    assert ring_only.allreduce_terms(ours=False) == (1 * MS, 2e-9)  # the ring's β stands in for the backend's
    probed = dataclasses.replace(ring_only, allreduce_s_per_byte=5e-9, allreduce_bytes=1000)
    assert probed.allreduce_terms(ours=False, nbytes=1000) == (1 * MS, 5e-9)
    assert probed.allreduce_terms(ours=False) == probed.allreduce_terms(ours=False, nbytes=1001) == (1 * MS, 2e-9)


@pytest.mark.multiprocess
def test_the_setup_probe_measures_both_allreduces_among_the_workers():
    """At a 1 MiB gradient (one bucket): at 256 KB, a 1-element allreduce slowed by a busy machine once
    took longer than the gradient's, and the line's β read 0."""
    measured = measure_setup(2, 1, seconds=0.05, rounds=3, compute_rounds=1, ring_bytes=1 << 20)
    assert measured.ring_s_per_byte > 0 and measured.allreduce_latency_s > 0 and measured.allreduce_cpu_s > 0
    assert measured.ring_cpu(2, 1 << 17) > 0 and "ring CPU" in measured.describe()
    assert measured.ring_cpu_bytes == 1 << 20 and "quant8 ring" in measured.describe()
    assert all((measured.codec_ring_cpu(name, 2, 1 << 20) or 0) > 0 for name in ("trunc16", "quant8"))
    assert Setup.from_dict(dataclasses.asdict(measured), read_field) == measured
    assert measured.allreduce_terms(ours=True) == (measured.ring_latency_s or measured.latency_s,
                                                   measured.ring_s_per_byte)
    # the backend's allreduce: its own line, through 1 element and the job's gradient (1 MiB, a bucket)
    assert measured.allreduce_bytes == 1 << 20 and measured.allreduce_s_per_byte > 0
    assert measured.allreduce_terms(ours=False, nbytes=1 << 20) == (measured.allreduce_latency_s,
                                                                    measured.allreduce_s_per_byte)
    assert measured.allreduce_terms(ours=False, nbytes=1 << 21)[1] == measured.ring_s_per_byte
    assert measured.idle_ring_s_per_byte > 0 and measured.allreduce_terms(ours=True, idle=True) == \
        (measured.idle_ring_latency_s, measured.idle_ring_s_per_byte)
    assert all((measured.idle_ring(name, 2, 1 << 20) or 0) > 0 for name in ("none", "trunc16", "quant8"))
    assert "quant8 ring" in measured.describe() and "ms idle" in measured.describe()
    assert "ring" in measured.describe() and "allreduce" in measured.describe()
    assert measured.jitter_s >= 0 and "ms of compute" in measured.describe()
    assert 0 < measured.copy_s_per_byte < 1e-7 and 0 < measured.add_s_per_byte < 1e-7  # over 10 MB/s
    assert 0 < measured.idle_latency_s and "idle" in measured.describe()


@pytest.mark.multiprocess
def test_where_workers_share_cores_the_set_up_times_pipe_sgds_loop_with_each_codec(monkeypatch: pytest.MonkeyPatch):
    """Two workers on what the set-up takes for one core: it times pipe-sgd's loop at the job's gradient,
    plain and with each lossy codec; with a core each (this machine's two) it does not."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    measured = measure_setup(2, 1, seconds=0.05, rounds=3, compute_rounds=1, ring_bytes=1 << 18)
    assert all((measured.period(name, 2, 1 << 18) or 0) > 0 for name in ("none", "trunc16", "quant8"))
    assert measured.period("none", 3, 1 << 18) is None and measured.period("none", 2, 1 << 19) is None
    assert "quant8 pipe-sgd iteration" in measured.describe()
    assert Setup.from_dict(dataclasses.asdict(measured), read_field) == measured
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert measure_setup(2, 1, seconds=0.05, rounds=3, compute_rounds=1, ring_bytes=1 << 18).period_s == {}


@pytest.mark.multiprocess
def test_a_set_up_for_a_pipeline_leaves_our_rings_cpu_unmeasured():
    """Only pipe-sgd is priced with our ring's CPU: without it, the set-up at a gradient the probe would
    time every codec's ring at has none of it, and its ring CPU falls back to a send and a receive."""
    measured = measure_setup(2, 1, seconds=0.05, rounds=3, compute_rounds=1, ring_bytes=1 << 18, ring_cpu=False)
    assert (measured.ring_cpu_s, measured.ring_cpu_s_per_byte, measured.codec_ring_cpu_s, measured.ring_cpu_bytes) == \
        (0.0, 0.0, {}, 0)
    assert measured.ring_cpu(2, 1000) == pytest.approx(2 * 2 * measured.message_cpu(1000))
    assert measured.ring_s_per_byte > 0 and measured.allreduce_latency_s > 0  # what a replicated stage needs


def test_staggered_calls_time_the_call_alone_after_each_ranks_own_wait():
    """Before each call a rank spins a different time of up to STAGGER_S (its own random sequence), the
    first two calls are not kept, and a reading is the call's time, not the wait's: the time from one
    call's start to the next is the reading plus a wait."""
    import time

    waits = []
    for rank in (0, 1):
        starts: list[float] = []

        def call() -> None:
            starts.append(time.perf_counter())
            time.sleep(0.001)
        wall, cpu = staggered_calls(call, rank, rounds=6)
        assert len(wall) == len(cpu) == 6 and len(starts) == 8
        assert min(wall) >= 0.001 and all(c < w for c, w in zip(cpu, wall))
        waits.append([b - a - w for a, b, w in zip(starts[2:], starts[3:], wall)])
        assert min(waits[-1]) > -1e-4 and max(waits[-1]) > 0.05 * STAGGER_S
    assert waits[0] != pytest.approx(waits[1], abs=1e-4)  # each rank its own waits: they arrive apart


def test_staggered_calls_run_the_work_before_each_call_untimed():
    """With ``work`` (a training step, as a job computes before its sync), every call, the two untimed
    ones too, comes after one run of it, and the readings leave it out."""
    import time

    log: list[str] = []

    def work() -> None:
        log.append("work")
        time.sleep(0.01)

    def call() -> None:
        log.append("call")
        time.sleep(0.001)
    wall, _ = staggered_calls(call, 0, rounds=3, work=work)
    assert log == ["work", "call"] * 5
    assert len(wall) == 3 and max(wall) < 0.008


def test_a_gpipe_plan_is_predicted_at_its_microbatches():
    """Two stages of 1 ms forward and 2 ms backward per minibatch, free links, no optimizer time: GPipe
    with m microbatches takes (m + S - 1)(f + b)/m per minibatch, 5 x 0.75 = 3.75 ms at m = 4 (6 ms at
    m = 1: one minibatch at a time)."""
    layers = [LayerProfile(str(i), 0.5 * MS, 1 * MS, 0, 0) for i in range(4)]
    profile = Profile(layers, batch_size=8, device="test")
    straight = Plan([StagePlan(0, 1, 1), StagePlan(2, 3, 1)], noam=1, stage_time_s=3 * MS, speedup_vs_one=2,
                    speedup_vs_dp=1)
    assert predict_plan(profile, straight, Link(), 8, GPipe(microbatches=4)) == pytest.approx(8 / (3.75 * MS))
    assert predict_plan(profile, straight, Link(), 8, GPipe()) == pytest.approx(8 / (6 * MS))


def test_an_epochs_prediction_counts_filling_and_draining_the_pipeline():
    """pipedream, two stages of 1 ms forward and 2 ms backward, free links, no optimizer time: steady, a
    minibatch every 3 ms. An epoch of one minibatch takes 1 + 1 + 2 + 2 = 6 ms; of two, stage 0 runs F0
    F1 at 0-2, stage 1 F0 B0 F1 B1 at 1-2, 2-4, 4-5, 5-7, stage 0 B0 B1 at 4-6, 7-9: 9 ms."""
    layers = [LayerProfile(str(i), 0.5 * MS, 1 * MS, 0, 0) for i in range(4)]
    profile = Profile(layers, batch_size=8, device="test")
    straight = Plan([StagePlan(0, 1, 1), StagePlan(2, 3, 1)], noam=2, stage_time_s=3 * MS, speedup_vs_one=2,
                    speedup_vs_dp=1)
    assert predict_plan(profile, straight, Link(), 8) == pytest.approx(8 / (3 * MS))
    assert predict_plan(profile, straight, Link(), 8, minibatches=1, epoch=True) == pytest.approx(8 / (6 * MS))
    assert predict_plan(profile, straight, Link(), 8, minibatches=2, epoch=True) == pytest.approx(16 / (9 * MS))


def test_a_microbatch_profile_stands_for_the_minibatch_its_microbatches_make():
    micro = Profile([LayerProfile("a", 1 * MS, 2 * MS, 100, 40, optimizer_s=0.5 * MS)], batch_size=16,
                    device="test", input_bytes=64, setup=setup())
    whole = as_minibatch(micro, 4)
    assert (whole.batch_size, whole.input_bytes, whole.setup) == (64, 256, micro.setup)
    layer = whole.layers[0]
    assert (layer.forward_s, layer.backward_s, layer.activation_bytes) == pytest.approx((4 * MS, 8 * MS, 400))
    assert (layer.parameter_bytes, layer.optimizer_s) == (40, 0.5 * MS)  # one optimizer step per minibatch
    assert whole.meta == {"measured_at_batch": 16, "microbatches": 4}


def test_the_planner_counts_the_optimizer_step():
    """Four layers of equal compute; layer 0's optimizer step is as long as two layers' compute, so the
    balanced split moves from [0, 2] to [0, 1]."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100, optimizer_s=6 * MS if i == 0 else 0.0) for i in range(4)]
    profile = Profile(layers, batch_size=8, device="test", input_bytes=10)
    assert plan(profile, 2, "100Gbit", straight=True).boundaries == [0, 1]
    without = Profile([LayerProfile(x.name, x.forward_s, x.backward_s, 10, 100) for x in layers], 8, "test")
    assert plan(without, 2, "100Gbit", straight=True).boundaries == [0, 2]


def test_the_planner_charges_message_latency_to_every_boundary():
    """Two layers whose split halves the compute: worth it on a free link, not with 10 ms per message."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100) for i in range(2)]
    fast = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=setup(latency_s=0.0, slowdown=1.0))
    slow = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=setup(latency_s=10 * MS, slowdown=1.0))
    assert len(plan(fast, 2, "100Gbit", straight=True, fewer_workers=True).stages) == 2
    assert len(plan(slow, 2, "100Gbit", straight=True, fewer_workers=True).stages) == 1


def test_the_output_stage_pays_no_message_latency():
    """Nothing leaves the output stage. With 10 ms per message, one stage of two layers (1 + 2 ms each)
    on one worker takes its 6 ms per minibatch, not the 20 ms of a boundary behind it; split in two, the
    one boundary between the stages pays 2 x (10 ms + 10 B x 1 us/B)."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100) for i in range(2)]
    slow = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=setup(latency_s=10 * MS, slowdown=1.0))
    assert plan(slow, 1, "100Gbit").stage_time_s == pytest.approx(6 * MS)
    assert plan(slow, 2, "100Gbit", straight=True).stage_time_s == pytest.approx(2 * (10 * MS + 10e-6))


def test_one_stage_on_every_worker_is_priced_as_the_partitioner_prices_a_stage():
    """Two layers (3 ms of forward and backward each, 100 bytes of weights) on 4 workers as one stage,
    no set-up: PipeDream's T = max(6 ms, parameter-server sync of 4 x 3/4 x 200 B at 100 Gbit/s) / 4."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100) for i in range(2)]
    one = plan(Profile(layers, batch_size=8, device="test", input_bytes=10), 4, "100Gbit", one_stage=True)
    assert (one.replicas, one.boundaries, one.noam) == ([4], [0], 1)
    assert one.stage_time_s == pytest.approx(6 * MS / 4)
    assert one.speedup_vs_dp == pytest.approx(1.0)


def test_auto_runs_the_partitioners_plan_against_one_stage_and_takes_the_faster(monkeypatch):
    """The partitioner's plan, here forced to two stages with 2 x 40 kB crossing a link of 10 ms per
    message, against both layers on both workers: simulated, one stage is faster and is taken."""
    import pipetrain.auto as auto
    from pipetrain.config import Training

    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 40_000, 100) for i in range(2)]
    slow_link = setup(cores=8, slowdown=1.0, latency_s=10 * MS, allreduce_latency_s=0.1 * MS, ring_s_per_byte=1e-9)
    profile = Profile(layers, batch_size=8, device="test", input_bytes=10, setup=slow_link)
    asked: list[dict] = []
    monkeypatch.setattr(auto, "measured_profile", lambda *args, **kwargs: asked.append(kwargs) or profile)
    monkeypatch.setattr(auto, "plan", lambda p, w, b, straight=False, one_stage=False:
                        plan(p, w, b, straight=not one_stage, one_stage=one_stage))
    data = TensorDataset(torch.zeros(64, 1), torch.zeros(64, 1))
    training = Training(model=nn.Linear(1, 1), dataset=data, loss_fn=nn.functional.mse_loss,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=8)
    found = auto._plan_here(training, PipeDream(), 2, "1Gbit", 1)
    chosen = Plan.from_dict(found["plan"])
    simulated = chosen.options["simulated_samples_per_s"]
    assert chosen.config == "2" and set(simulated) == {"1-1", "2"}
    assert found["predicted"] == simulated["2"] > simulated["1-1"]
    assert asked == [{"ring_cpu": False}]  # a pipeline is not priced with our ring's CPU: not measured


def test_profile_times_the_optimizer_and_leaves_the_model_as_it_was(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    adam = functools.partial(torch.optim.Adam, lr=0.1)
    measured = profile_model(model, batch, nn.functional.cross_entropy, optimizer=adam, repeats=3, warmup=2)
    assert [x.optimizer_s > 0 for x in measured.layers] == [True, False, True]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    measured.setup = setup()
    measured.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.setup == setup() and again.layers == measured.layers
    old = json.loads((tmp_path / "p.json").read_text())
    del old["setup"]
    for entry in old["layers"]:
        del entry["optimizer_s"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Profile.load(tmp_path / "old.json").layers[0].optimizer_s == 0.0


def heavy_weights() -> Profile:
    """Four layers with 25 MB of weights each and small activations: a pipeline's job at 100 Mbit/s."""
    layers = [LayerProfile(str(i), 10 * MS, 20 * MS, 4_000, 25_000_000) for i in range(4)]
    return Profile(layers, batch_size=32, device="test", input_bytes=4_000)


def light_weights() -> Profile:
    """Four layers of 4 KB weights and 40 MB activations: data parallelism's job."""
    layers = [LayerProfile(str(i), 10 * MS, 20 * MS, 40_000_000, 4_000) for i in range(4)]
    return Profile(layers, batch_size=32, device="test", input_bytes=40_000_000)


def test_auto_picks_a_pipeline_when_weights_are_heavy_and_the_link_slow():
    choice = choose_strategy(heavy_weights(), 4, "100Mbit")
    assert choice.choice == "pipeline"
    assert set(choice.predictions) == {"pipeline", "ddp", "pipe-sgd", "pipe-sgd-trunc16", "pipe-sgd-quant8"}
    assert "cgdp" in choice.skipped  # a link between workers: not one machine
    assert choice.predictions["pipeline"] > 2 * choice.predictions["ddp"]
    assert choice.reason.startswith("pipeline is predicted fastest for 4 workers at 100 Mbit/s")
    data = json.loads(json.dumps(choice.to_dict()))
    assert data["choice"] == "pipeline" and data["predictions"]["ddp"] == choice.predictions["ddp"]


def test_auto_prices_a_one_stage_plan_as_data_parallelism():
    choice = choose_strategy(light_weights(), 4, "10Gbit")
    assert choice.choice in ("ddp", "pipe-sgd")
    assert "pipeline" not in choice.predictions and "data parallelism" in choice.skipped["pipeline"]


def test_a_codec_is_predicted_but_picked_only_when_allowed():
    """Heavy weights, 2 workers: a pipeline of 2 stages still sends 50 MB per allreduce less than
    data parallelism, but quant8's ring sends a quarter of that."""
    profile = heavy_weights()
    refused = choose_strategy(profile, 2, "1Gbit", strategies=["ddp", "pipe-sgd", "pipe-sgd-quant8"])
    allowed = choose_strategy(profile, 2, "1Gbit", strategies=["ddp", "pipe-sgd", "pipe-sgd-quant8"],
                              allow_compression=True)
    assert refused.predictions["pipe-sgd-quant8"] > refused.predictions["pipe-sgd"]
    assert refused.choice == "pipe-sgd" and "allow_compression" in refused.skipped["pipe-sgd-quant8"]
    assert "pipe-sgd-quant8 would be" in refused.reason
    assert allowed.choice == "pipe-sgd-quant8"


def test_cgdp_competes_on_one_machine():
    choice = choose_strategy(light_weights(), 2, host_costs={"copy_s_per_byte": 1e-10, "sum_s_per_byte": 1e-10})
    assert "cgdp" in choice.predictions and choice.options["cgdp"]["chunk"] >= 1


def test_cgdp_takes_the_fewest_chunks_of_the_sizes_it_prices_alike():
    """Free copies, sums and signals price every chunk size of 4 layers alike; chunk size 3 makes the
    fewest chunks ([0, 1, 2] and [3]; 2 makes three, 1 and 4 four)."""
    layers = [LayerProfile(str(i), 1 * MS, 2 * MS, 10, 100) for i in range(4)]
    profile = Profile(layers, batch_size=8, device="test", input_bytes=10)
    choice = choose_strategy(profile, 2, host_costs={"copy_s_per_byte": 0.0, "sum_s_per_byte": 0.0},
                             strategies=["cgdp"])
    assert choice.options["cgdp"]["chunk"] == 3


def test_auto_refuses_what_it_would_choose_and_unknown_names():
    with pytest.raises(ValueError, match="unknown strategies"):
        choose_strategy(light_weights(), 2, strategies=["gpipe"])
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    with pytest.raises(ValueError, match="chooses stages itself"):
        pipetrain.train(nn.Sequential(nn.Linear(4, 2)), data, loss_fn=nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy="auto", workers=2,
                        stages=[0], batch_size=8)
    with pytest.raises(ValueError, match="needs workers"):
        pipetrain.train(nn.Sequential(nn.Linear(4, 2)), data, loss_fn=nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy="auto", batch_size=8)


@pytest.mark.multiprocess
def test_train_auto_measures_chooses_and_trains_the_choice(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    result = pipetrain.train(model, data, loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy="auto", workers=2,
                             batch_size=16, epochs=1, timeout=60)
    assert result.choice is not None and result.choice["choice"] in result.choice["predictions"]
    assert result.predicted_samples_per_s == result.choice["predictions"][result.choice["choice"]]
    assert len(result.history) == 4
    out = capsys.readouterr().out
    assert "strategy auto" in out and result.choice["reason"] in out
    assert "measured set-up: 2 workers x 1 threads" in out
