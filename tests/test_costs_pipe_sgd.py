"""Pipe-SGD's timing models (eq. 2-7) from the paper's text, and the simulator and CLI that use them.

Expected values are worked out by hand from §3.1 of the paper, not from pipetrain.costs.
"""
from __future__ import annotations

import json

import pytest

from pipetrain import costs
from pipetrain.cli import main
from pipetrain.registry import PipeSGD, make
from pipetrain.predict import predict_data_parallel
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import build_data_parallel
from pipetrain.schedule import validate
from pipetrain.simulate import Link


def test_a_rings_cpu_and_where_it_is_charged_by_hand() -> None:
    # 4 ranks: 2 (4 - 1) = 6 steps of 1 ms + 1000 B x 1 us/B
    assert costs.ring_allreduce_cpu_s(4, 1000, 1e-3, 1e-6) == pytest.approx(6 * 2e-3)
    # update 1 s, compute 2 s, 3 CPU seconds of communication: two cores each overlap it; one core each
    # adds it; half a core each (every core busy with two workers' compute) adds it twice over
    assert costs.shared_core_compute_s(1.0, 2.0, 3.0, 2.0) == 3.0
    assert costs.shared_core_compute_s(1.0, 2.0, 3.0, 1.0) == 6.0
    assert costs.shared_core_compute_s(1.0, 2.0, 3.0, 0.5) == 9.0
    # below a core each, a CPU second costs what compute does where that is more than 1 / cores
    assert costs.shared_core_compute_s(1.0, 2.0, 3.0, 0.5, slowdown=2.6) == pytest.approx(3.0 + 3.0 * 2.6)
    assert costs.shared_core_compute_s(1.0, 2.0, 3.0, 0.5, slowdown=1.5) == 9.0
    assert costs.shared_core_compute_s(1.0, 2.0, 3.0, 1.0, slowdown=2.6) == 6.0


def test_equations_2_to_7_by_hand() -> None:
    # T = 10 iterations, l_up = 1, l_comp = 2, l_comm = 5 (seconds)
    assert costs.sync_sgd_time(10, 1, 2, 5) == 80                  # eq. 2: 10 (1 + 2 + 5)
    assert costs.pipe_sgd_ideal_time(10, 2, 1, 2, 5) == 40         # eq. 3: 10 / 2 (1 + 2 + 5)
    assert costs.pipe_sgd_time(10, 1, 2, 5) == 50                  # eq. 4: 10 max(3, 5)
    assert costs.pipe_sgd_time(10, 1, 2, 2) == 30                  # compute bound: 10 max(3, 2)
    # ring over p = 4: 2 (p-1) L α + 2 (p-1)/p n β + (p-1)/p n γ + L S
    ring = costs.ring_allreduce_time(4, 1000, latency_s=1e-3, byte_s=1e-6, reduce_byte_s=1e-7, sync_s=0.01)
    assert ring == pytest.approx(0.006 + 0.0015 + 0.000075 + 0.01)
    ring4 = costs.ring_allreduce_time(4, 1000, 1e-3, 1e-6, 1e-7, sync_s=0.01, segments=4)
    assert ring4 == pytest.approx(0.024 + 0.0015 + 0.000075 + 0.04)  # L = 4 latencies and syncs
    assert costs.pipe_sgd_sequential_time(10, 0.1, 0.2, 0.3, ring) == pytest.approx(6.0)   # eq. 5: compute bound
    assert costs.pipe_sgd_pipelined_time(10, 0.1, 0.2, 0.01, ring4) == pytest.approx(10 * 0.31)  # eq. 6
    assert costs.pipe_sgd_pipelined_time(10, 0.001, 0.002, 0.001, ring4) == pytest.approx(10 * ring4)
    assert costs.scaling_efficiency(1, 2, 5) == pytest.approx(3 / 5)  # eq. 7
    assert costs.scaling_efficiency(1, 2, 2) == 1.0


def one_layer(forward: float = 0.01, backward: float = 0.02, parameter_bytes: int = 4_000_000) -> Profile:
    return Profile([LayerProfile("all", forward, backward, 100, parameter_bytes)], batch_size=8, device="test",
                   input_bytes=100)


@pytest.mark.parametrize("staleness,bandwidth,update", [(1, 1e9, 0.005), (2, 1e9, 0.005), (2, 1e9, 0.0),
                                                       (2, 1e8, 0.005), (3, 1e8, 0.005)])
def test_simulator_runs_the_data_parallel_schedule_at_the_closed_form(staleness: int, bandwidth: float,
                                                                      update: float) -> None:
    """The same action lists the runtime runs give eq. 4 (K >= 2) and eq. 2 (K = 1) in steady state
    (the drained updates at the end, back to back, are not steady state and are left out)."""
    profile = one_layer()
    pred = predict_data_parallel(profile, 2, Link(bandwidth), staleness=staleness, own_ring=True, update_s=update,
                                 reduce_s=0.0, minibatches=40)
    compute = (0.01 + 0.02) / 2  # each of 2 workers takes half of the 8 samples
    comm = 4_000_000 / bandwidth  # 2 (p-1)/p n β with p = 2: the whole gradient once
    assert (pred.compute_s, pred.comm_s) == pytest.approx((compute, comm))
    per_iteration = max(compute + update, comm) if staleness > 1 else compute + update + comm
    assert pred.samples_per_s == pytest.approx(8 / per_iteration, rel=1e-6)
    assert pred.formula_samples_per_s == pytest.approx(8 / per_iteration)
    assert pred.bound == ("compute" if compute + update >= comm else "communication")


def test_compression_shrinks_the_payload_the_model_charges() -> None:
    plain = predict_data_parallel(one_layer(), 4, Link(1e8), staleness=2, own_ring=True, reduce_s=0.0)
    trunc = predict_data_parallel(one_layer(), 4, Link(1e8), staleness=2, own_ring=True, compression="trunc16", reduce_s=0.0)
    quant = predict_data_parallel(one_layer(), 4, Link(1e8), staleness=2, own_ring=True, compression="quant8", reduce_s=0.0)
    assert plain.payload_bytes == 4_000_000 and trunc.payload_bytes == 2_000_000
    # 1M floats in 4 blocks of 250,880 (a multiple of 1024): a byte each plus a float32 scale per 1024
    assert quant.payload_bytes == 4 * (250_880 + 4 * 245)
    assert plain.comm_s > trunc.comm_s > quant.comm_s
    with pytest.raises(ValueError, match="the backend's allreduce takes no compression"):
        predict_data_parallel(one_layer(), 2, Link(1e8), buckets_in_backward=True, compression="quant8")
    with pytest.raises(ValueError, match="compression applies to strategy 'pipe-sgd', not 'ddp'"):
        make("strategy", "ddp", {"compression": "quant8"})


def test_data_parallel_schedule_is_valid_and_drains() -> None:
    for k in (1, 2, 3):
        s = build_data_parallel(PipeSGD(staleness=k), 3, 7)
        validate(s)
        acts = [str(a) for a in s.actions[0]]
        assert acts.count("U0") == 1 and [a for a in acts if a[0] == "U"] == [f"U{t}" for t in range(7)]
        # the update of minibatch t comes right after the backward of t + K - 1 (or at the end)
        for t in range(7 - k + 1):
            assert acts.index(f"U{t}") > acts.index(f"B{t + k - 1}") and acts.index(f"U{t}") < acts.index(
                f"F{t + k}") if t + k < 7 else True
    assert " ".join(map(str, build_data_parallel(PipeSGD(staleness=2), 2, 3).actions[1])) == \
        "F0 B0 A0 F1 B1 A1 S0 U0 F2 B2 A2 S1 U1 S2 U2"


def test_cli_simulate_pipe_sgd_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    one_layer().save(path)
    assert main(["simulate", str(path), "--strategy", "pipe-sgd", "--workers", "2", "--bandwidth", "1Gbit",
                 "--compression", "trunc16", "--staleness", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategy"] == "pipe-sgd" and out["compression"] == "trunc16" and out["payload_bytes"] == 2_000_000
    assert 0 < out["scaling_efficiency"] <= 1 and out["samples_per_s"] > 0
    assert main(["simulate", str(path), "--strategy", "pipe-sgd", "--plan", "x.json"]) == 1
    assert "takes --workers N" in capsys.readouterr().err
