"""``pipetrain bench`` end to end on loopback with a tiny model: every system reports positive numbers.

The emulated cluster itself is covered by tests/test_cluster.py; here every job runs on 127.0.0.1.
"""
from __future__ import annotations

import json
import math
from unittest import mock

import pytest

from pipetrain.bench.report import TARGETS, format_table, judge_auto
from pipetrain.bench.systems import SYSTEMS, SuiteConfig, microbatch_counts
from pipetrain.cli import main
from pipetrain.zoo import SPECS

TINY = ["--model", "mnist-mlp", "--batch-size", "16", "--microbatches", "2", "--warmup", "1",
        "--windows", "1", "--steps-per-window", "1", "--timeout", "60"]


@pytest.mark.multiprocess
def test_bench_json_has_every_system(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """Asked for an emulated link where none can be built, it says why in one line and uses loopback."""
    png = tmp_path / "bench.png"
    why = "EmulatedCluster needs root (CAP_NET_ADMIN) to create network namespaces"
    with mock.patch("pipetrain.bench.cluster.unavailable_reason", return_value=why):
        assert main(["bench", *TINY, "--link", "1gbit", "--json", "--png", str(png)]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if why in line] == [f"pipetrain bench: {why}; running on loopback"]
    report = json.loads(out)
    assert report["where"] == "loopback" and report["note"] == why
    for key in ("samples_per_s", "bytes_per_sample"):
        assert set(report[key]) == set(SYSTEMS), key
        assert all(math.isfinite(v) and v > 0 for v in report[key].values()), report[key]
    # mnist-mlp's automatic 2-stage plan is a straight pipeline, so every pipeline runs on its split
    assert report["split"]["stages"] == report["pipedream"]["stages"]
    assert report["split"]["source"].startswith("pipedream's automatic plan")
    # the pipelines send one cut's activations and gradients; DDP the whole gradient
    assert report["bytes_per_sample"]["ddp"] > report["bytes_per_sample"]["pipedream"]
    # every target but the predictions' (they need a link to predict for; loopback has none), cgdp's
    # and pipe-sgd's against K = 1 (extra systems)
    assert report["bound_samples_per_s"] > 0 and set(report["targets"]) == set(TARGETS) - {
        "prediction_error", "cgdp_vs_ddp", "pipe_sgd_vs_k1"}
    assert {"F", "B", "U"} <= {k for rank in report["pipedream"]["seconds_per_minibatch"] for k in rank}
    assert png.stat().st_size > 0
    assert "torch-1f1b" in format_table(report)


@pytest.mark.multiprocess
def test_ps_sync_runs_beside_ddp_with_one_more_process(capsys: pytest.CaptureFixture[str]) -> None:
    """2 workers: ddp on 2 processes, ps-sync on 3 (its server last); ps-sync's bytes are the server's."""
    assert main(["bench", *TINY, "--loopback", "--systems", "ddp,ps-sync", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["samples_per_s"]) == {"ddp", "ps-sync"} and not report["errors"]
    assert all(v > 0 for v in report["samples_per_s"].values())
    grad = 4 * sum(p.numel() for p in SPECS["mnist-mlp"].factory().parameters()) / 16  # bytes per sample
    # ddp's ring over 2 workers sends the gradient once a step; each ps-sync worker too, the server twice
    assert report["bytes_per_sample_per_rank"] == {"ddp": [grad, grad], "ps-sync": [grad, grad, 2 * grad]}
    assert report["bytes_per_sample"] == {"ddp": grad, "ps-sync": 2 * grad}
    assert "ps-sync: 2 workers and a parameter server (rank 2" in format_table(report)


@pytest.mark.multiprocess
def test_pipe_sgd_k1_runs_beside_k2(capsys: pytest.CaptureFixture[str]) -> None:
    """Named, pipe-sgd-k1 runs pipe-sgd at K = 1: the same bytes as K = 2, and K = 2 judged against it."""
    assert main(["bench", *TINY, "--loopback", "--systems", "pipe-sgd,pipe-sgd-k1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["samples_per_s"]) == {"pipe-sgd", "pipe-sgd-k1"} and not report["errors"]
    assert report["bytes_per_sample"]["pipe-sgd-k1"] == report["bytes_per_sample"]["pipe-sgd"]
    rates = report["samples_per_s"]
    assert report["targets"]["pipe_sgd_vs_k1"]["value"] == rates["pipe-sgd"] / rates["pipe-sgd-k1"]


@pytest.mark.multiprocess
def test_cgdp_is_timed_after_its_chunk_search(capsys: pytest.CaptureFixture[str]) -> None:
    """mnist-mlp has 3 layers with parameters: the search judges chunks 1..4 over 40 iterations."""
    assert main(["bench", *TINY, "--loopback", "--systems", "ddp,cgdp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["samples_per_s"]) == {"ddp", "cgdp"} and not report["errors"]
    assert report["bytes_per_sample"]["cgdp"] == 0  # shared memory: nothing crosses a link
    # 41 warm-up steps (the search's 40 and the first, not timed), 1 timed, 1 left out: 42 times recorded
    assert report["cgdp"]["search"]["done"] and report["cgdp"]["search"]["iterations"] == 42
    assert report["cgdp"]["chunks"][-1] == report["cgdp"]["search"]["best"]
    assert "cgdp_vs_ddp" in report["targets"]


def test_microbatch_counts_and_bad_config() -> None:
    cfg = SuiteConfig(model="mnist-mlp", batch_size=12, microbatches=(1, 2, 4, 5))
    assert microbatch_counts("torch-1f1b", cfg, 2) == [2, 4]       # 1F1B needs a microbatch per stage
    assert microbatch_counts("gpipe", cfg, 2) == [1, 2, 4]        # 5 does not split 12
    assert microbatch_counts("pipedream", cfg, 2) == [1]
    with pytest.raises(ValueError, match="unknown system"):
        SuiteConfig(systems=("pipedream", "horovod"))
    with pytest.raises(ValueError, match="one worker per stage"):
        SuiteConfig(stages=[0, 3, 5])
    assert SuiteConfig(systems=("ddp",)).hosts == 2 and SuiteConfig(systems=("ddp", "ps-sync")).hosts == 3


def test_auto_is_judged_against_every_run_and_among_exact_strategies() -> None:
    """With codecs allowed the pick is quant8 (predicted fastest), measured at 100 of the fastest 110
    (pipedream): met at 0.91; without codecs the pick is the pipeline, the fastest exact strategy."""
    from pipetrain.planning.choose import Choice

    options = {"pipeline": {"strategy": "pipeline"}, "ddp": {"strategy": "ddp"},
               "pipe-sgd-quant8": {"strategy": "pipe-sgd", "compression": "quant8"}}
    choice = Choice("pipe-sgd-quant8", {"pipeline": 100.0, "ddp": 50.0, "pipe-sgd-quant8": 120.0}, options)
    judged = judge_auto(choice, {"pipedream": 110.0, "ddp": 60.0, "pipe-sgd-quant8": 100.0})
    assert judged["measured"] == {"pipeline": 110.0, "ddp": 60.0, "pipe-sgd-quant8": 100.0}
    assert judged["any"] == {"pick": "pipe-sgd-quant8", "best": "pipeline", "pick_vs_best": 100 / 110, "met": True}
    assert judged["exact"] == {"pick": "pipeline", "best": "pipeline", "pick_vs_best": 1.0, "met": True}
    # a pipeline priced as data parallelism is no candidate, but its run still counts as the fastest
    dp_only = Choice("ddp", {"ddp": 50.0}, {"ddp": {"strategy": "ddp"}},
                     {"pipeline": "the best plan is one stage on every worker"})
    judged = judge_auto(dp_only, {"pipedream": 110.0, "ddp": 60.0})
    assert judged["any"] == {"pick": "ddp", "best": "pipeline", "pick_vs_best": 60 / 110, "met": False}


@pytest.mark.multiprocess
def test_bench_auto_on_loopback_prices_the_candidates_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``--auto``: a profile and set-up first, one prediction per candidate run, pipedream on the priced
    plan, and the pick judged against the measured rates."""
    assert main(["bench", *TINY, "--loopback", "--systems", "pipedream,ddp,pipe-sgd", "--auto", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    auto = report["auto"]
    assert set(auto["predictions"]) | set(auto["skipped"]) == {"pipeline", "ddp", "pipe-sgd"}  # cgdp is not run
    assert all(v > 0 for v in auto["predictions"].values())
    assert auto["measured"] == {"pipeline": report["samples_per_s"]["pipedream"], "ddp": report["samples_per_s"]["ddp"],
                                "pipe-sgd": report["samples_per_s"]["pipe-sgd"]}
    if "pipeline" in auto["options"]:
        assert report["pipedream"]["plan"] == auto["options"]["pipeline"]["stages"]
    best = max(auto["measured"], key=auto["measured"].get)
    assert auto["any"]["best"] == best and auto["any"]["pick"] == auto["choice"]
    assert auto["any"]["pick_vs_best"] == auto["measured"][auto["choice"]] / auto["measured"][best]
    assert "strategy auto (predicted from a profile" in format_table(report)
