"""Data-parallel predictions (ddp, pipe-sgd, cgdp) priced with a measured run set-up, worked out by
hand."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from handmade import MS, setup, two_layers

from pipetrain import costs
from pipetrain.planning.choose import choose_strategy
from pipetrain.jsonfile import read_field
from pipetrain.predict import predict_cgdp, predict_data_parallel
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import build_schedule
from pipetrain.setup import Setup
from pipetrain.simulate import Link, simulate


DDP = {"buckets_in_backward": True}
"""How ddp synchronizes: the backend's allreduce, its buckets inside the backward, K = 1."""


PIPE_SGD = {"staleness": 2, "own_ring": True}
"""How pipe-sgd synchronizes by default: our own ring, K = 2."""


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


def test_what_a_prediction_times_here_it_times_with_the_workers_thread_count(monkeypatch: pytest.MonkeyPatch):
    """The codec's arithmetic (pipe-sgd) and the host's copy and add (cgdp) are timed in this process,
    as a worker with the set-up's thread count runs them (their time depends on the thread count); this
    process's own count comes back."""
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
