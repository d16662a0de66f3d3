"""CGDP's cost model (§3.2, eq. 1-2) worked by hand from the paper's text, and the prediction CLI."""
from __future__ import annotations

import json

import pytest

from pipetrain import costs
from pipetrain.cli import main
from pipetrain.predict import predict_cgdp
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.setup import Setup

BP, AS, AA, BC = [1.0, 2.0, 3.0], [0.1, 0.1, 0.1], [0.5, 0.2, 0.05], [0.1, 0.1, 0.01]  # backward order


def test_equation_1_by_hand() -> None:
    # T_BP^i = sum_{j <= i} (t_bp + t_as) + t_aa^i + t_bc^i
    assert costs.cgdp_unit_times(BP, AS, AA, BC) == pytest.approx([1.1 + 0.6, 3.2 + 0.3, 6.3 + 0.06])
    assert costs.cgdp_backward_s(BP, AS, AA, BC) == pytest.approx(6.36)   # T = max
    assert costs.cgdp_overhead_s(BP, AS, AA, BC) == pytest.approx(0.36)   # T - T_BP
    assert costs.cgdp_overhead_eq2(AS, AA, BC) == pytest.approx(0.36)     # eq. 2: sum t_as + t_aa^1 + t_bc^1
    assert costs.dp_overhead_s(AA, BC) == pytest.approx(0.96)             # T'_O = sum (t_aa + t_bc)
    assert costs.cgdp_wins(AS, AA, BC)                                    # 0.3 < (0.5+0.1) + (0.2+0.1)
    assert not costs.cgdp_wins([0.4] * 3, AA, BC)                         # 1.2 > 0.9


def test_when_an_accumulation_outlasts_the_rest_of_the_backward() -> None:
    aa = [5.0, 0.2, 0.05]
    # unit 0's sum is back at 1.1 + 5 + 0.1 = 6.2 < 6.36: still hidden; at 6.0 it is not
    assert costs.cgdp_backward_s(BP, AS, aa, BC) == pytest.approx(6.36)
    assert costs.cgdp_backward_s(BP, AS, [6.0, 0.2, 0.05], BC) == pytest.approx(7.2)
    assert costs.cgdp_overhead_eq2(AS, [6.0, 0.2, 0.05], BC) == pytest.approx(0.36)  # eq. 2 assumes it is hidden
    # one summing thread: unit 1 waits for unit 0's sum (done at 6.1), unit 2 for unit 1's (6.3)
    assert costs.cgdp_unit_times(BP, AS, aa, BC, serial=True) == pytest.approx([6.2, 6.4, 6.36])
    assert costs.cgdp_backward_s(BP, AS, aa, BC, serial=True) == pytest.approx(6.4)
    assert costs.cgdp_backward_s(BP, AS, AA, BC, tail_s=1.0) == pytest.approx(7.3)  # the backward's tail


def profile() -> Profile:
    """Forward order: a parameter-free layer, then A (1000 B), a parameter-free one, B (3000 B)."""
    return Profile([LayerProfile("in", 0.0, 0.5, 10, 0), LayerProfile("a", 0.0, 1.0, 10, 1000),
                    LayerProfile("act", 0.0, 0.25, 10, 0), LayerProfile("b", 0.0, 2.0, 10, 3000)],
                   batch_size=4, device="test", input_bytes=10)


def test_prediction_groups_layers_into_the_papers_chunks() -> None:
    p = predict_cgdp(profile(), 1, 1, copy_s_per_byte=1e-4, sum_s_per_byte=0.0, signal_s=0.0)
    # backward order: b (2.0), then act + a (0.25 + 1.0), then the tail "in" (0.5)
    assert [c["layers"] for c in p.chunks] == [[3], [1, 2]]
    assert [c["bp_s"] for c in p.chunks] == pytest.approx([2.0, 1.25])
    assert [c["aa_s"] for c in p.chunks] == pytest.approx([0.3, 0.1])  # copies, 1e-4 s per byte
    assert p.plain_backward_s == pytest.approx(3.75)
    # b's sum is back at 2.3, a's at 3.25 + 0.1 = 3.35; the backward ends at 3.75 anyway
    assert p.backward_s == pytest.approx(3.75) and p.overhead_s == pytest.approx(0.0)
    slow = predict_cgdp(profile(), 1, 1, copy_s_per_byte=1e-3, sum_s_per_byte=0.0, signal_s=0.0)
    # b at 2 + 3 = 5.0; a waits for the summing thread: 5.0 + 1.0 = 6.0
    assert slow.backward_s == pytest.approx(6.0) and slow.overhead_s == pytest.approx(2.25)
    one = predict_cgdp(profile(), 1, 3, copy_s_per_byte=1e-3, sum_s_per_byte=0.0, signal_s=0.0)
    assert [c["layers"] for c in one.chunks] == [[1, 2, 3]] and one.backward_s == pytest.approx(3.25 + 4.0)


def test_signals_take_their_cpu_from_a_backward_on_shared_cores() -> None:
    """Two workers on one core: the summing thread's copies (4000 B x 1e-4 s) and each chunk's two
    signals (0.2 s of CPU each) run on the core the backward uses, which both workers' share, so a CPU
    second of them costs each worker 2 s: the backward (3.75 s) ends 2 x 1.2 s later with two chunks,
    2 x 0.8 s with one; with a core each they overlap it."""
    def with_cores(cores: int) -> Profile:
        p = profile()
        p.setup = Setup(backend="gloo", workers=2, threads=1, cores=cores, slowdown=1.0, latency_s=0.0,
                        s_per_byte=0.0, message_cpu_s=0.0, message_cpu_s_per_byte=0.0, copy_s_per_byte=0.0,
                        allreduce_cpu_s=0.2)
        return p

    for chunk, by_hand in ((1, 3.75 + 2 * (0.4 + 4 * 0.2)), (3, 3.75 + 2 * (0.4 + 2 * 0.2))):
        shared = predict_cgdp(with_cores(1), 1, chunk, copy_s_per_byte=1e-4, sum_s_per_byte=0.0, signal_s=0.0)
        assert shared.backward_s == pytest.approx(by_hand)
    roomy = predict_cgdp(with_cores(4), 1, 1, copy_s_per_byte=1e-4, sum_s_per_byte=0.0, signal_s=0.0)
    assert roomy.backward_s == pytest.approx(3.75)


def test_cli_simulate_cgdp_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    profile().save(path)
    assert main(["simulate", str(path), "--strategy", "cgdp", "--workers", "2", "--chunk", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategy"] == "cgdp" and out["chunk"] == 3 and len(out["chunks"]) == 1  # 3 > 2 layers: one chunk
    assert out["overhead_s"] >= 0 and out["iteration_s"] > 0 and out["copy_s_per_byte"] > 0
    assert main(["simulate", str(path), "--strategy", "cgdp", "--workers", "2", "--chunk", "0"]) == 1
    assert "chunk=0: give the layers per chunk" in capsys.readouterr().err
