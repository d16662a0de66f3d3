"""interleaved-1f1b: several stages per worker, round robin; its order, validation, simulation and runs."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.cli import main
from pipetrain.registry import Interleaved1F1B, OneFOneBFlush, build_schedule
from pipetrain.runtime.multi import edges as multi_edges
from pipetrain.runtime.multi import stage_view
from pipetrain.runtime.transport import Message, _decode, _encode
from pipetrain.schedule import Schedule, ScheduleError, validate
from pipetrain.schedule.actions import BACKWARD, FORWARD, Action
from pipetrain.schedule.interleaved import evaluation
from pipetrain.simulate import simulate
from pipetrain.trace import draw_timeline, write_chrome_trace
from pt_models import SIZES, mlp
from test_simulate import B, F, equal_profile


def interleaved(workers: int, per_worker: int, microbatches: int, minibatches: int = 2) -> Schedule:
    return Interleaved1F1B(microbatches=microbatches, workers=workers).build([1] * (workers * per_worker),
                                                                          minibatches)


def test_action_text_names_the_stage_and_round_trips():
    for text in ("F3.1s2", "B0s0", "RF2.0s5", "SB1s1", "U4", "F3.1", "RB2"):
        assert str(Action.parse(text)) == text
    assert Action.parse("F3.1s2") == Action(FORWARD, 3, 1, 2)
    assert Action.parse("SF3.1s1").counterpart() == Action.parse("RF3.1s2")
    assert Action.parse("RB0s1").counterpart() == Action.parse("SB0s2")
    assert Action.parse("SF3").counterpart() == Action.parse("RF3")
    schedule = interleaved(2, 2, 4)
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert "looped=2" in schedule.to_text().splitlines()[0]


def test_worker_w_holds_stages_w_w_plus_W_and_runs_only_them():
    schedule = interleaved(3, 2, 3)
    assert schedule.num_workers == 3 and schedule.num_stages == 6
    assert [schedule.stages_of(w) for w in range(3)] == [(0, 3), (1, 4), (2, 5)]
    for w, acts in enumerate(schedule.actions):
        assert {a.stage for a in acts if a.kind in (FORWARD, BACKWARD)} == {w, w + 3}
    with pytest.raises(ValueError, match="stages_of"):
        schedule.stage_of(0)


def test_megatron_warm_up_then_one_forward_one_backward():
    """W = 4, v = 2, m = 8: worker w runs (W - w - 1) * 2 + (v - 1) * W forwards before its first
    backward (Megatron's count), in turns of W microbatches per stage, then alternates."""
    W, v, m = 4, 2, 8
    schedule = interleaved(W, v, m, minibatches=1)
    for w, acts in enumerate(schedule.actions):
        compute = [a for a in acts if a.kind in (FORWARD, BACKWARD)]
        warm = (W - w - 1) * 2 + (v - 1) * W
        assert [a.kind for a in compute[:warm]] == [FORWARD] * warm
        assert [a.stage for a in compute[:W]] == [w] * W and compute[W].stage == w + W
        steady = v * m - warm
        assert [a.kind for a in compute[warm:warm + 2 * steady]] == [FORWARD, BACKWARD] * steady
        assert [a.kind for a in compute[warm + 2 * steady:]] == [BACKWARD] * warm
        assert compute[-1] == Action(BACKWARD, 0, m - 1, w)  # the worker's first stage drains last
        for s in schedule.stages_of(w):  # each stage runs its microbatches in order, forward and backward
            for kind in (FORWARD, BACKWARD):
                assert [a.micro for a in compute if a.stage == s and a.kind == kind] == list(range(m))
        assert [str(a) for a in acts if a.kind == "U"] == ["U0"]  # one update of every stage it holds


@pytest.mark.parametrize("workers,per_worker,microbatches", [
    (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 3, 6), (2, 1, 4), (3, 2, 3), (3, 2, 2), (3, 3, 9), (4, 2, 4), (4, 2, 8),
    (4, 2, 3), (4, 2, 5), (4, 4, 12), (5, 2, 10)])
def test_validator_finds_no_deadlock(workers, per_worker, microbatches):
    schedule = interleaved(workers, per_worker, microbatches, minibatches=3)
    stats = validate(schedule)
    assert len(stats["steps"]) == workers
    # every worker makes one update per minibatch, after all its stages' microbatches
    for acts in schedule.actions:
        assert [a.mb for a in acts if a.kind == "U"] == [0, 1, 2]
    validate(evaluation(workers, workers * per_worker, 3))  # forward only, each worker its stages in turn


def test_a_swapped_receive_deadlocks_and_the_grid_names_the_stages():
    schedule = interleaved(2, 2, 2, minibatches=1)
    acts = list(schedule.actions[1])
    i = acts.index(Action.parse("RF0.0s1"))
    j = acts.index(Action.parse("RF0.0s3"))
    acts[i], acts[j] = acts[j], acts[i]
    broken = Schedule(schedule.name, schedule.replicas, (schedule.actions[0], tuple(acts)),
                      schedule.microbatches, looped=2)
    with pytest.raises(ScheduleError, match=r"deadlocks(.|\n)*w1 \(stages 1,3\)"):
        validate(broken)


@pytest.mark.parametrize("workers,stages,microbatches,words", [
    (2, 3, 4, "give a multiple of 2 stages"), (3, 2, 3, "give a multiple of 3 stages"),
    (4, 8, 9, "microbatches 9 is not a multiple of 2 rounds"), (2, 4, 5, "not a multiple of 2 rounds")])
def test_bad_combinations_are_one_line_errors(workers, stages, microbatches, words):
    with pytest.raises(ValueError, match=words) as err:
        Interleaved1F1B(microbatches=microbatches, workers=workers).build([1] * stages, 2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="workers=1 must be an integer >= 2"):
        Interleaved1F1B(workers=1)


def test_workers_must_be_given_and_stages_straight():
    with pytest.raises(ValueError, match="needs workers=W"):
        Interleaved1F1B(microbatches=2).build([1] * 4, 1)
    with pytest.raises(ValueError, match="straight pipelines only"):
        Interleaved1F1B(microbatches=2, workers=2).build([2, 1, 1, 1], 2)


@pytest.mark.parametrize("workers,per_worker,microbatches", [(2, 2, 4), (2, 2, 2), (4, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_simulated_bubble_is_megatrons(workers, per_worker, microbatches):
    """Equal stages, free links: a minibatch takes v (F + B) of compute per worker plus the bubble
    (W - 1)(F + B) / m, 1/v of 1F1B's over the same workers (arXiv:2104.04473 §2.2)."""
    W, v, m = workers, per_worker, microbatches
    result = simulate(interleaved(W, v, m, minibatches=1), equal_profile(v * W), list(range(v * W)))
    assert result.makespan_s == pytest.approx(v * (F + B) + (W - 1) * (F + B) / m)
    flush = simulate(build_schedule(OneFOneBFlush(microbatches=m), [1] * W, 1), equal_profile(v * W),
                     list(range(0, v * W, v)))
    bubble, flush_bubble = result.makespan_s - v * (F + B), flush.makespan_s - v * (F + B)
    assert bubble == pytest.approx(flush_bubble / v)


def test_simulated_trace_draws_with_several_stages_per_worker(tmp_path):
    schedule = interleaved(2, 2, 4)
    result = simulate(schedule, equal_profile(4), [0, 1, 2, 3])
    for w, records in enumerate(result.trace):
        assert [Action.parse(text) for text, _, _ in records] == list(schedule.actions[w])
    assert result.minibatches_per_s > 0 and len(result.peak_activation_bytes) == 2
    draw_timeline(result.trace, tmp_path / "timeline.png", title="interleaved-1f1b",
                  names=[f"worker {w} (stages {w},{w + 2})" for w in range(2)])
    write_chrome_trace(result.trace, tmp_path / "trace.json")
    assert (tmp_path / "timeline.png").stat().st_size > 0 and "F0.0s2" in (tmp_path / "trace.json").read_text()


def test_each_stage_worker_sees_its_stage_actions_as_a_straight_pipeline():
    schedule = interleaved(2, 2, 2, minibatches=2)
    view = stage_view(schedule)
    assert view.looped is None and view.num_workers == 4 and view.stage_of(3) == 3
    assert view.actions[2] == tuple(a.local() for a in schedule.actions[0] if a.stage in (None, 2))
    assert [str(a) for a in view.actions[1] if a.kind == "U"] == ["U0", "U1"]
    validate(view)
    assert multi_edges(4, 2) == [(0, 1), (1, 0)] and len(multi_edges(6, 3)) == 6


def test_a_message_header_carries_the_boundary_it_crosses():
    head = _encode(Message(3, 1, 5, [torch.zeros(2, 3, dtype=torch.float64)], False, 0, 2), torch.device("cpu"))
    mb, micro, version, is_tuple, channel, cut, specs = _decode(head)
    assert (mb, micro, version, is_tuple, channel, cut) == (3, 1, 5, False, 0, 2)
    assert specs == [(torch.float64, [2, 3])]


def test_simulate_cli_places_the_stages_with_looped(tmp_path, capsys):
    equal_profile(4).save(tmp_path / "p.json")
    argv = ["simulate", str(tmp_path / "p.json"), "--stages", "0,1,2,3", "--schedule", "interleaved-1f1b",
            "--microbatches", "4", "--minibatches", "1", "--json", "--png", str(tmp_path / "t.png")]
    assert main([*argv, "--looped", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan_s"] == pytest.approx(2 * (F + B) + (F + B) / 4, rel=1e-3) and len(out["busy_fraction"]) == 2
    assert (tmp_path / "t.png").stat().st_size > 0
    assert main(argv) == 1
    assert "--looped W goes with --stages" in capsys.readouterr().err


# -- runs -------------------------------------------------------------------------------------------

MINIBATCHES, BATCH, LR = 6, 4, 0.05


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(MINIBATCHES * BATCH, SIZES[0], generator=g, dtype=torch.float64),
                         torch.randn(MINIBATCHES * BATCH, SIZES[-1], generator=g, dtype=torch.float64))


def _mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


def _minibatch_sgd(epochs: int = 1) -> list[torch.Tensor]:
    """The whole model's plain minibatch SGD, written out: tanh layers, a linear head, mean squared error;
    the minibatches in dataset order every epoch."""
    params = [p.detach().clone() for p in mlp().parameters()]
    x_all, y_all = _data().tensors
    for t in [t for _ in range(epochs) for t in range(MINIBATCHES)]:
        leaves = [p.clone().requires_grad_() for p in params]
        h = x_all[t * BATCH:(t + 1) * BATCH]
        for i in range(0, len(leaves), 2):
            h = h @ leaves[i].T + leaves[i + 1]
            if i < len(leaves) - 2:
                h = torch.tanh(h)
        loss = ((h - y_all[t * BATCH:(t + 1) * BATCH]) ** 2).mean()
        params = [p - LR * g for p, g in zip(params, torch.autograd.grad(loss, leaves))]
    return params


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers,stages,microbatches,loader_workers", [
    (2, [0, 2, 4, 6], 2, 0), (2, [0, 2, 4, 6], 4, 1),
    (3, [0, 1, 2, 3, 4, 6], 2, 0),  # fewer microbatches than workers; stages 1 and 3 hold a Tanh alone
])
def test_looped_stages_equal_plain_minibatch_sgd(workers, stages, microbatches, loader_workers, tmp_path):
    result = pipetrain.train(mlp(), _data(), loss_fn=torch.nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=LR), stages=stages, workers=workers,
                             schedule=Interleaved1F1B(microbatches=microbatches), batch_size=BATCH, shuffle=False,
                             timeout=60, trace=tmp_path, loader_workers=loader_workers, eval_dataset=_data(),
                             metrics={"mae": _mae})
    assert [h["step"] for h in result.history] == list(range(1, MINIBATCHES + 1))
    want = _minibatch_sgd()
    for got, param in zip(result.model.parameters(), want):
        torch.testing.assert_close(got.detach(), param, rtol=0, atol=1e-9)
    # held out: the trained model on every item (minibatches of equal size: the mean of their means)
    x, y = _data().tensors
    h = x
    for i in range(0, len(want), 2):
        h = h @ want[i].T + want[i + 1]
        h = torch.tanh(h) if i < len(want) - 2 else h
    scores = result.history[-1]["eval"]
    assert scores["loss"] == pytest.approx(float(((h - y) ** 2).mean()), abs=1e-9)
    assert scores["mae"] == pytest.approx(float((h - y).abs().mean()), abs=1e-9)
    held = list(range(1, len(stages), workers))
    assert len(result.traces) == workers
    assert {Action.parse(text).stage for text, _, _ in result.traces[1]} == {*held, None}
    assert f"worker 1 (stages {', '.join(map(str, held))})" in (tmp_path / "trace.json").read_text()
    assert (tmp_path / "timeline.png").stat().st_size > 0


@pytest.mark.multiprocess
def test_a_resumed_run_goes_on_as_if_never_stopped(tmp_path):
    """Two epochs saved (a file per stage), then a third resumed from them: the model of three epochs
    of plain minibatch SGD, and every step's record."""
    kw = dict(loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR),
              stages=[0, 2, 4, 6], workers=2, schedule=Interleaved1F1B(microbatches=2), batch_size=BATCH,
              shuffle=False, timeout=60, checkpoint_dir=tmp_path)
    pipetrain.train(mlp(), _data(), epochs=2, **kw)
    assert {p.name for p in tmp_path.glob("w*-epoch1.pt")} == {f"w{s}-epoch1.pt" for s in range(4)}
    result = pipetrain.train(mlp(), _data(), epochs=3, resume=True, **kw)
    assert result.epochs_trained == 1
    assert [h["step"] for h in result.history] == list(range(1, 3 * MINIBATCHES + 1))
    for got, want in zip(result.model.parameters(), _minibatch_sgd(epochs=3)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-9)


def _train(**kw):
    args = dict(loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                stages=[0, 2, 4, 6], workers=2, schedule=Interleaved1F1B(microbatches=2), batch_size=BATCH)
    return pipetrain.train(mlp(), _data(), **{**args, **kw})


@pytest.mark.parametrize("kw,words", [
    (dict(workers=3), "give a multiple of 3 stages"),
    (dict(workers=None), "interleaved-1f1b needs workers=W"),
    (dict(schedule=Interleaved1F1B(microbatches=2, workers=4)), "workers=2 but the schedule says workers=4"),
    (dict(schedule=Interleaved1F1B(microbatches=4), stages=[0, 1, 2, 3, 4, 5], workers=4),
     "give a multiple of 4 stages"),
    (dict(schedule=Interleaved1F1B(microbatches=3)), "batch_size 4 is not divisible by microbatches 3"),
    (dict(stages="auto"), "a plan places one stage per worker"),
    (dict(schedule="interleaved-1f1b", batch_size=4, workers=2, stages=[0, 2, 4]), "give a multiple of 2 stages"),
])
def test_bad_requests_are_refused_in_one_line_before_any_worker_starts(kw, words):
    with pytest.raises(ValueError, match=words) as err:
        _train(**kw)
    assert "\n" not in str(err.value)


def test_tied_parameters_are_refused_in_one_line():
    from test_tied import TiedNet, dataset
    with pytest.raises(ValueError, match=r"does not run tied parameters yet \(parameter emb.weight") as err:
        pipetrain.train(TiedNet(), dataset(), loss_fn=torch.nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=LR), stages=[0, 1, 3, 5], workers=2,
                        schedule="interleaved-1f1b", batch_size=BATCH)
    assert "\n" not in str(err.value)
