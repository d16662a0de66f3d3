"""Activation recomputation (``recompute=True``): the same results as without it, in float64, with dropout
drawing the same masks; less kept between forward and backward; the planner's memory model knows it.

Independent references: plain SGD and weight stashing from tests/test_runtime_exact.py, and the tied
model's reference from tests/test_tied.py.
"""
import functools
import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
import test_runtime_exact as exact
import test_tied as tied
from launching import ROOT
from pipetrain.costs import stage_memory_bytes
from pipetrain.planning import plan
from pipetrain.profiling import LayerProfile, Profile

N_MB, BATCH, WIDE = 6, 8, 64


def dropout_mlp() -> nn.Sequential:
    """Two stages at [0, 4], each with dropout, whose insides (WIDE) dwarf what crosses a cut (4)."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(4, WIDE), nn.Dropout(0.3), nn.Tanh(), nn.Linear(WIDE, 4),
                         nn.Tanh(), nn.Linear(4, WIDE), nn.Tanh(), nn.Dropout(0.3), nn.Linear(WIDE, 3)).double()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(9)
    return TensorDataset(torch.randn(N_MB * BATCH, 4, generator=g, dtype=torch.float64),
                         torch.randn(N_MB * BATCH, 3, generator=g, dtype=torch.float64))


def train(schedule, recompute: bool, **kw) -> pipetrain.TrainResult:
    args = dict(loss_fn=nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                stages=[0, 4], schedule=schedule, batch_size=BATCH, shuffle=False, seed=3, timeout=60)
    return pipetrain.train(dropout_mlp(), data(), **{**args, **kw}, recompute=recompute)


def assert_equal(a: nn.Module, b: nn.Module) -> None:
    for (k, v), (k2, w) in zip(a.state_dict().items(), b.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, w, rtol=0, atol=1e-12)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["pipedream", pipetrain.PipeDream(vertical_sync=True), pipetrain.GPipe(2),
                                      pipetrain.OneFOneBFlush(2), "model-parallel"], ids=str)
def test_recompute_gives_the_same_weights_with_dropout(schedule) -> None:
    plain, again = train(schedule, False), train(schedule, True)
    assert_equal(again.model, plain.model)
    assert [h["loss"] for h in again.history] == [h["loss"] for h in plain.history]
    # without dropout's masks replayed the runs would differ: dropout really draws
    assert plain.history[0]["loss"] != train(schedule, False, seed=4).history[0]["loss"]


def norm_mlp() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(4, WIDE), nn.BatchNorm1d(WIDE), nn.Tanh(), nn.Linear(WIDE, 4),
                         nn.Linear(4, WIDE), nn.BatchNorm1d(WIDE), nn.Tanh(), nn.Linear(WIDE, 3)).double()


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["pipedream", pipetrain.GPipe(2)], ids=str)
def test_batch_norm_statistics_move_once(schedule) -> None:
    runs = [pipetrain.train(norm_mlp(), data(), loss_fn=nn.functional.mse_loss, stages=[0, 4], schedule=schedule,
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=BATCH, shuffle=False,
                            timeout=60, recompute=recompute) for recompute in (False, True)]
    assert_equal(runs[1].model, runs[0].model)  # running means and variances too, and the batch counts
    assert int(runs[1].model[1].num_batches_tracked) == N_MB * (2 if schedule != "pipedream" else 1)


@pytest.mark.multiprocess
def test_recompute_keeps_less_and_reports_it(tmp_path) -> None:
    """GPipe with 4 microbatches: without recompute a stage keeps 4 microbatches' activations; with it,
    their inputs, and one microbatch's activations while it reruns."""
    plain, again = train(pipetrain.GPipe(4), False), train(pipetrain.GPipe(4), True, trace=tmp_path)
    assert_equal(again.model, plain.model)
    for full, kept in zip(plain.stashed_bytes, again.stashed_bytes):
        assert kept["activation_bytes"] < 0.4 * full["activation_bytes"]
        assert full["weight_bytes"] == kept["weight_bytes"] == 0  # a flush schedule stashes no weights
    # stage 1's rerun saves the wide Tanh's output, dropout's mask and the last Linear's input (WIDE wide), the
    # first Tanh's output (4 wide), the loss's output and target (3 wide), float64, 2 rows a microbatch;
    # beside it every microbatch's received input (4 wide) is kept
    rows = BATCH // 4
    rerun = rows * (3 * WIDE + 4 + 2 * 3) * 8
    assert again.stashed_bytes[1]["activation_bytes"] == 4 * rows * 4 * 8 + rerun
    samples = again.memory_traces[1]
    assert max(a for _, a, _ in samples) == again.stashed_bytes[1]["activation_bytes"] and samples[-1][1] == 0
    counters = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {0, 1} and all(e["name"] == "stashed bytes" for e in counters)
    peak = max(e["args"]["activations"] for e in counters if e["pid"] == 1)
    assert peak == again.stashed_bytes[1]["activation_bytes"]


@pytest.mark.multiprocess
def test_pipedream_stashes_weight_versions_and_reports_them() -> None:
    result = train("pipedream", True)
    # stage 0 holds two minibatches in flight: up to two versions of its weights (4x64 + 64 + 64x4 + 4)
    assert result.stashed_bytes[0]["weight_bytes"] == 2 * (4 * WIDE + WIDE + WIDE * 4 + 4) * 8
    assert result.stashed_bytes[1]["weight_bytes"] == 0  # the output stage runs the live weights


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule,rule", [
    ("pipedream", exact.stashed), (pipetrain.PipeDream(vertical_sync=True), exact.vertical),
    (pipetrain.GPipe(2), exact.plain), (pipetrain.OneFOneBFlush(2), exact.plain), ("model-parallel", exact.plain),
], ids=str)
def test_recompute_matches_the_independent_reference(schedule, rule) -> None:
    exact.assert_same(exact.run(schedule, recompute=True), exact.reference(rule), tol=1e-12)


@pytest.mark.multiprocess
def test_recompute_uses_the_tied_copy_the_forward_used() -> None:
    n = len(tied.STAGES)
    want = tied.reference(lambda s, t: max(0, t - 1 - (n - s)), lambda t: max(0, t - n))
    result = pipetrain.train(tied.TiedNet(), tied.dataset(), loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=tied.LR), stages=tied.STAGES,
                             batch_size=tied.BATCH, shuffle=False, timeout=60, schedule="pipedream", recompute=True)
    tied.assert_matches(result.model, want)
    # the output stage holds E's copies (VOCAB x WIDTH float64) of the minibatches in flight, one at most
    assert result.stashed_bytes[2]["weight_bytes"] == tied.VOCAB * tied.WIDTH * 8


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "cgdp", "pipe-sgd"])
def test_data_parallel_recomputes_too(strategy) -> None:
    args = dict(strategy=strategy, workers=2, stages=None)
    assert_equal(train(None, True, **args).model, train(None, False, **args).model)


def test_a_bad_recompute_value_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^recompute='yes' must be True .* or False$"):
        train("gpipe", "yes")  # type: ignore[arg-type]


def profile() -> Profile:
    """Four layers with large insides: activations 300 B a layer, weights 10 B, the input 1 B."""
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 300, 10) for i in range(4)]
    return Profile(layers, batch_size=1, device="cpu", input_bytes=1)


def test_the_memory_model_counts_inputs_and_one_rerun() -> None:
    # 3 in flight: weights live + 3 versions; activations 3 x 401 without, 2 inputs + 401 with
    assert stage_memory_bytes(40, 401, 3) == 40 * 4 + 401 * 3
    assert stage_memory_bytes(40, 401, 3, input_bytes=1, recompute=True) == 40 * 4 + 1 * 2 + 401
    assert stage_memory_bytes(40, 401, 3, weight_versions=0) == 40 + 401 * 3


def test_a_memory_limit_only_the_recompute_plan_meets() -> None:
    """Two straight stages, pipedream: the input stage holds 2 minibatches and 2 weight versions.
    [0,1][2,3]: 3 x 20 + 2 x 601 = 1262 without, 3 x 20 + 1 + 601 = 662 with; its output stage 940 either
    way. [0][1,2,3] needs 1240 and [0,1,2][3] 1022 with recompute: only the first fits 1000 B, and only
    with recompute."""
    with pytest.raises(ValueError, match="no configuration of 4 layers on 2 workers fits within .*recompute=True"):
        plan(profile(), 2, "1GB/s", straight=True, memory=1000)
    chosen = plan(profile(), 2, "1GB/s", straight=True, memory=1000, recompute=True)
    assert [(s.first_layer, s.last_layer) for s in chosen.stages] == [(0, 1), (2, 3)]
    assert chosen.options["recompute"] is True
    # the schedule's counts: gpipe with 4 microbatches keeps 4 quarter-minibatches and no weight versions
    assert plan(profile(), 2, "1GB/s", straight=True, memory=1000, schedule=pipetrain.GPipe(4)).stages


def test_the_schedules_count_what_they_hold() -> None:
    assert pipetrain.PipeDream().in_flight(1, 3) == pipetrain.PipeDream().weight_versions(1, 3) == 3
    assert pipetrain.PipeDream().in_flight(2, 6) == 3
    assert pipetrain.GPipe(4).in_flight(1, 2) == 4 and pipetrain.GPipe(4).weight_versions(1, 2) == 0
    assert pipetrain.OneFOneBFlush(4).in_flight(1, 2) == 2 and pipetrain.OneFOneBFlush(4).in_flight(1, 8) == 4
    assert pipetrain.ModelParallel().in_flight(1, 4) == 1


@pytest.mark.parametrize("kw,message", [
    (dict(stages=[0, 4], memory_limit="1GiB"), r"^memory_limit='1GiB' is what stages='auto' plans within"),
    (dict(stages="auto", workers=2, memory_limit="lots"), r"^cannot read memory_limit 'lots'; write it like 16GiB"),
])
def test_a_bad_memory_limit_is_one_line(kw, message) -> None:
    with pytest.raises(ValueError, match=message) as e:
        train("pipedream", False, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.multiprocess
def test_an_automatic_plan_within_a_memory_limit_counts_recompute() -> None:
    result = train("pipedream", True, stages="auto", workers=2, memory_limit="1GiB")
    assert result.plan is not None and result.plan.options["recompute"] is True
    assert result.plan.options["memory"] == 2**30


def test_the_plan_command_takes_recompute(capsys, tmp_path) -> None:
    from pipetrain.cli import main
    path = tmp_path / "profile.json"
    profile().save(path)
    main(["plan", str(path), "--workers", "2", "--straight", "--memory", "1000", "--recompute", "--json"])
    assert '"recompute": true' in capsys.readouterr().out


@pytest.mark.multiprocess
def test_the_train_command_recomputes(tmp_path) -> None:
    saved = []
    for flags in ((), ("--recompute",)):
        out = tmp_path / f"model{len(flags)}.pt"
        done = subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", "examples.mlp_job:model", "--data",
                               "examples.mlp_job:data", "--stages", "0,4", "--loss", "mse_loss", "--batch-size", "16",
                               "--schedule", "gpipe", "--microbatches", "4", "--save", str(out), *flags],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "peak stashed activations / weight versions per worker: " in done.stdout
        assert "peak resident memory per worker, predicted / measured: " in done.stdout
        saved.append(torch.load(out, weights_only=True))
    for k, v in saved[0].items():
        assert torch.equal(v, saved[1][k])
