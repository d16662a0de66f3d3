"""The run set-up's probes: ``measure_setup`` among real worker processes (marked multiprocess), and
the timing helpers it is built from."""
from __future__ import annotations

import dataclasses
import math
import os
import pickle
import time

import pytest
import torch
from torch import nn

from handmade import MS
from pt_models import Spell

from pipetrain.jsonfile import read_field
from pipetrain.setup import Setup, layer_step, measure_setup, model_step
from pipetrain.setup.collectives import STAGGER_S, staggered_calls
from pipetrain.setup.compute import SETTLE_EXCESS, jitter_of_calls
from pipetrain.setup.messages import COMPUTING_ROUNDS_SECONDS, computing_rounds


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


def test_the_probes_jitter_is_the_variance_of_every_workers_calls_per_second():
    """Calls of 1 and 3 ms on one worker, 2 and 2 ms on another: mean 2 ms, variance 0.5 ms², 0.25 ms per
    second of compute."""
    assert jitter_of_calls([[1 * MS, 3 * MS], [2 * MS, 2 * MS]]) == pytest.approx(0.25 * MS)
    assert jitter_of_calls([[2 * MS]]) == 0.0


@pytest.mark.multiprocess
def test_the_setup_probe_measures_both_allreduces_among_the_workers():
    """At a 1 MiB gradient (one bucket): large enough that its allreduce outlasts a 1-element one even on
    a busy machine, so each line's β reads above 0."""
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
    plain and with each lossy codec; with a core each (two cores) it does not."""
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


def test_a_layer_stands_in_for_a_slow_models_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    # the first layer after the first, before the last, at least the median of those: layer 2 (3 >= 3)
    kernel = layer_step(model, x, [5.0, 1.0, 3.0, 3.0, 9.0], seconds=1.0)
    assert kernel is not None and list(kernel.stage.children()) == [model[2]]
    assert torch.equal(kernel.inputs, torch.relu(model[0](x))[:1])  # 1 s of 3 s: a third of 5 rows
    assert torch.equal(layer_step(model, x, [5.0, 1.0, 3.0, 3.0, 9.0], seconds=2.0).inputs,
                       torch.relu(model[0](x))[:3])
    kernel()  # a forward and backward, leaving no gradient behind
    assert model[2].weight.grad is None and not kernel.inputs.requires_grad
    assert len(pickle.dumps(kernel)) < len(pickle.dumps(model))  # only the layer travels to the probes
    assert layer_step(model, x, [1.0, 2.0], seconds=1.0) is None
