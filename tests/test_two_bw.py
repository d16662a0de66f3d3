"""PipeDream-2BW (``2bw``): its schedule, its weight versions, and exactness in float64.

The reference keeps every version of each stage's weights, W_s[0], W_s[1], ..., and for minibatch t
(1-based, of an epoch that starts at version b) takes the mean over its microbatches of the loss's
gradient with every stage at W_s[b + max(0, t-2)]; update t gives W_s[b+t] = W_s[b+t-1] - lr * that
gradient. A stage of r replicas counts in rounds: round k (its minibatches r(k-1)+1 .. rk) runs at
W_s[b + max(0, k-2)] and update k applies the round's mean gradient.
"""
import functools
import json
import re
import subprocess
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.cli import main
from pipetrain.planning import Plan, StagePlan
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.registry import TwoBW, build_schedule, from_options, make, schedule_of
from pipetrain.runtime.weights import DoubleBuffered
from pipetrain.schedule import Schedule, validate
from pipetrain.simulate import simulate
from launching import ROOT
from pt_models import SIZES, mlp

N_MB, BATCH, LR = 6, 12, 0.05
CUTS = {2: [0, 4], 3: [0, 2, 4]}  # the 7 layers of pt_models.mlp cut into 2 or 3 stages


def compute(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in acts if a.kind in "FBU") for acts in schedule.actions]


def test_order_is_1f1b_over_every_microbatch_with_an_update_after_each_minibatch():
    s = build_schedule(TwoBW(microbatches=2), [1, 1], 3)
    assert compute(s) == ["F0.0 F0.1 B0.0 F1.0 B0.1 U0 F1.1 B1.0 F2.0 B1.1 U1 F2.1 B2.0 B2.1 U2",
                          "F0.0 B0.0 F0.1 B0.1 U0 F1.0 B1.0 F1.1 B1.1 U1 F2.0 B2.0 F2.1 B2.1 U2"]
    assert " ".join(map(str, s.actions[1][:5])) == "RF0.0 F0.0 B0.0 SB0.0 RF0.1"
    assert (s.name, s.microbatches, s.double_buffered, s.stashes) == ("2bw", 2, True, True)
    # a replica starts its sync after its minibatch's last backward and waits for it before its next backward
    s = build_schedule(TwoBW(microbatches=2), [2, 1], 4)
    assert " ".join(map(str, s.actions[0])) == ("F0.0 SF0.0 F0.1 SF0.1 RB0.0 B0.0 RB0.1 B0.1 A0 F2.0 SF2.0 F2.1 SF2.1 "
                                                "S0 U0 RB2.0 B2.0 RB2.1 B2.1 A2 S2 U2")
    assert compute(s)[2] == "F0.0 B0.0 F0.1 B0.1 U0 F1.0 B1.0 F1.1 B1.1 U1 F2.0 B2.0 F2.1 B2.1 U2 F3.0 B3.0 F3.1 B3.1 U3"


def test_text_form_round_trips_and_every_depth_is_deadlock_free():
    layouts = [[1] * n for n in range(1, 7)] + [[2, 1], [1, 2], [2, 2], [1, 3, 1], [3, 1, 2], [2, 1, 1, 2]]
    for replicas in layouts:
        n = len(replicas)
        for m in (n, n + 2):
            s = build_schedule(TwoBW(microbatches=m), replicas, 6)
            assert Schedule.from_text(s.to_text()) == s
            assert "double_buffered=1" in s.to_text().splitlines()[0]
            assert all(k <= 2 for k in validate(s)["peak_in_flight"])  # microbatches of two minibatches at most
    assert "double_buffered" not in build_schedule("pipedream", [1, 1], 2).to_text()


def test_named_with_its_options():
    assert make("schedule", "2bw", {"microbatches": 3}) == TwoBW(microbatches=3) == schedule_of("2bw", 3)
    assert pipetrain.TwoBW is TwoBW


@pytest.mark.parametrize("replicas,microbatches,says", [
    ([1, 1, 1], 2, "schedule '2bw' needs microbatches >= the number of stages (3), got 2; use microbatches=3"),
    ([1, 1], 1, "needs microbatches >= the number of stages (2), got 1"),
    ([2, 1, 1], 2, "needs microbatches >= the number of stages (3), got 2"),
])
def test_bad_layouts_are_refused_in_one_line(replicas, microbatches, says):
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        build_schedule(TwoBW(microbatches=microbatches), replicas, 4)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="microbatches=0 must be an integer >= 1"):
        TwoBW(microbatches=0)


@pytest.mark.parametrize("schedule", [TwoBW(microbatches=2), "2bw"], ids=str)
def test_train_refuses_too_few_microbatches_before_any_worker_starts(schedule):
    """Unmarked: a worker process started here would fail the test (conftest)."""
    with pytest.raises(ValueError, match=r"needs microbatches >= the number of stages \(3\), got [12]") as e:
        run(schedule, 3)
    assert "\n" not in str(e.value)


def test_cli_takes_2bw_and_refuses_too_few_microbatches_in_one_line(tmp_path, capsys):
    profile = Profile([LayerProfile(str(i), 1e-3, 2e-3, 1000, 100) for i in range(3)], batch_size=1,
                      device="test", input_bytes=500)
    profile.save(tmp_path / "p.json")
    argv = ["simulate", str(tmp_path / "p.json"), "--stages", "0,1,2", "--schedule", "2bw", "--minibatches", "4"]
    assert main([*argv, "--microbatches", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_weight_versions"] == [2, 2, 2]
    assert main([*argv, "--microbatches", "2"]) == 1
    err = capsys.readouterr().err
    assert "needs microbatches >= the number of stages (3), got 2" in err and err.count("\n") == 1


def test_simulator_prices_no_flush_and_reports_two_versions_at_every_stage():
    f, b, n, m = 1e-3, 2e-3, 3, 4
    profile = Profile([LayerProfile(str(i), f, b, 1000, 100) for i in range(n)], batch_size=1, device="test",
                      input_bytes=500)
    result = simulate(build_schedule(TwoBW(microbatches=m), [1] * n, 12), profile, list(range(n)))
    assert result.peak_weight_versions == [2] * n
    assert result.minibatches_per_s == pytest.approx(1 / (f + b))  # steady state: no bubble between minibatches
    replicated = simulate(build_schedule(TwoBW(microbatches=m), [2, 1, 1], 12), profile, list(range(n)))
    assert replicated.peak_weight_versions == [2] * 4
    flush = simulate(build_schedule(schedule_of("1f1b-flush", m), [1] * n, 12), profile, list(range(n)))
    assert flush.minibatches_per_s < 0.8 / (f + b)


# -- exactness --------------------------------------------------------------------------------------

def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N_MB * BATCH, SIZES[0], generator=g, dtype=torch.float64)
    y = torch.randn(N_MB * BATCH, SIZES[-1], generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def reference(microbatches: int, epochs: int = 1, lag: int = 2, cuts: list[int] = CUTS[2],
              replicas: tuple[int, ...] = (1, 1)) -> list[torch.Tensor]:
    """Every Linear's weight and bias after training, stage by stage: a stage of r replicas updates once
    per round of r minibatches with their mean gradient, and runs minibatch t of an epoch that started
    at its version b at W_s[b + max(0, (t-1)//r + 1 - lag)] (lag 2: 2bw; lag 1: plain minibatch SGD)."""
    params = [p.detach().clone() for p in mlp().parameters()]
    stage_of = [sum(c <= 2 * (i // 2) for c in cuts) - 1 for i in range(len(params))]  # Linear l is layer 2l
    hist = [[[p for p, s in zip(params, stage_of) if s == st]] for st in range(len(cuts))]
    pending: list[list[list[torch.Tensor]]] = [[] for _ in cuts]
    x_all, y_all = dataset().tensors
    for _ in range(epochs):
        base = [len(h) - 1 for h in hist]
        for t in range(1, N_MB + 1):
            at = [hist[st][base[st] + max(0, (t - 1) // r + 1 - lag)] for st, r in enumerate(replicas)]
            used = [p.clone().requires_grad_() for ps in at for p in ps]
            x, y = x_all[(t - 1) * BATCH:t * BATCH], y_all[(t - 1) * BATCH:t * BATCH]
            size = BATCH // microbatches
            losses = []
            for k in range(microbatches):
                h = x[k * size:(k + 1) * size]
                for i in range(0, len(used), 2):
                    h = h @ used[i].T + used[i + 1]
                    if i < len(used) - 2:
                        h = torch.tanh(h)
                losses.append(((h - y[k * size:(k + 1) * size]) ** 2).mean())
            grads = torch.autograd.grad(sum(losses) / microbatches, used)
            for st, r in enumerate(replicas):
                pending[st].append([g for g, s in zip(grads, stage_of) if s == st])
                if len(pending[st]) == r:
                    mean = [sum(gs) / r for gs in zip(*pending[st])]
                    hist[st].append([p - LR * g for p, g in zip(hist[st][-1], mean)])
                    pending[st].clear()
    return [p for h in hist for p in h[-1]]


def run(schedule, n: int, **kw) -> pipetrain.TrainResult:
    args = dict(loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                stages=CUTS[n], schedule=schedule, batch_size=BATCH, epochs=1, shuffle=False, seed=0, timeout=60)
    return pipetrain.train(mlp(), dataset(), **{**args, **kw})


def test_the_reference_differs_from_plain_sgd():
    """Guards the exactness tests: a one-update lag really changes the result."""
    assert (reference(2)[0] - reference(2, lag=1)[0]).abs().max() > 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,m,epochs", [(2, 2, 1), (2, 3, 2), (3, 3, 1), (3, 4, 1)])
def test_2bw_is_exact(n, m, epochs):
    result = run(TwoBW(microbatches=m), n, epochs=epochs)
    assert [h["step"] for h in result.history] == list(range(1, epochs * N_MB + 1))
    got = list(result.model.parameters())
    for g, w in zip(got, reference(m, epochs)):
        torch.testing.assert_close(g.detach(), w, rtol=0, atol=1e-9)
    assert result.weight_versions == [2] * n  # double buffering: never a third version


@pytest.mark.multiprocess
@pytest.mark.parametrize("cuts,replicas,m", [([0, 4], (2, 1), 2), ([0, 4], (1, 2), 3), ([0, 2, 4], (1, 2, 1), 3)],
                         ids=str)
def test_replicated_2bw_is_exact(cuts, replicas, m):
    """Replica i of a stage of r takes minibatches i, i+r, ...; round q of them runs at the stage's
    weights after max(0, q-1) updates, each the mean of a round's gradients (the replicas' allreduce)."""
    plan = Plan([StagePlan(a, b - 1, r) for a, b, r in zip(cuts, [*cuts[1:], 7], replicas)], noam=1,
                stage_time_s=1.0, speedup_vs_one=1.0, speedup_vs_dp=1.0)
    result = run(TwoBW(microbatches=m), len(cuts), stages=plan)
    assert [h["step"] for h in result.history] == list(range(1, N_MB + 1))
    want = reference(m, cuts=cuts, replicas=replicas)
    for g, w in zip(result.model.parameters(), want):
        torch.testing.assert_close(g.detach(), w, rtol=0, atol=1e-9)
    assert result.weight_versions == [2] * sum(replicas)
    if replicas == (2, 1):  # each replica: its 3 minibatches' activations, and one allreduce per round
        cut, grad = BATCH * 6 * 8, (4 * 6 + 6 + 6 * 6 + 6) * 8  # one minibatch's activations, stage 0's gradient
        assert result.bytes_sent == [3 * cut + 3 * grad] * 2 + [6 * cut]  # ring: 2(r-1)/r of it per allreduce
    assert max((a - b).abs().max().item() for a, b in zip(want, reference(m, cuts=cuts, replicas=(1,) * len(cuts)))) > 1e-6


@pytest.mark.multiprocess
def test_2bw_by_name_with_the_cli_options():
    """``--schedule 2bw --microbatches 2``, as the CLI turns its flags into a schedule."""
    _, schedule = from_options("pipeline", "2bw", microbatches=2)
    got = list(run(schedule, 2).model.parameters())
    for g, w in zip(got, reference(2)):
        torch.testing.assert_close(g.detach(), w, rtol=0, atol=1e-9)


@pytest.mark.multiprocess
def test_2bw_resumes_exactly(tmp_path):
    """An epoch starts from its first version at every stage, so a checkpoint holds all it needs."""
    run(TwoBW(microbatches=2), 2, checkpoint_dir=tmp_path)
    resumed = run(TwoBW(microbatches=2), 2, epochs=2, checkpoint_dir=tmp_path, resume=True)
    assert [h["step"] for h in resumed.history] == list(range(1, 2 * N_MB + 1))
    for g, w in zip(resumed.model.parameters(), reference(2, epochs=2)):
        torch.testing.assert_close(g.detach(), w, rtol=0, atol=1e-9)


@pytest.mark.multiprocess
def test_cli_trains_2bw_and_refuses_too_few_microbatches():
    job = [sys.executable, "-m", "pipetrain.cli", "train", "examples.mlp_job:model", "--data", "examples.mlp_job:data",
           "--stages", "0,4", "--loss", "mse_loss", "--batch-size", "16", "--schedule", "2bw"]
    r = subprocess.run([*job, "--microbatches", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "final loss" in r.stdout
    r = subprocess.run(job, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert "needs microbatches >= the number of stages (2), got 1" in r.stderr


@pytest.mark.multiprocess
def test_weight_versions_of_the_other_schedules():
    """Weight stashing holds a version per minibatch in flight (2 on the input stage of 2), the
    output stage and flush schedules one: the live weights."""
    assert run("pipedream", 2, batch_size=4).weight_versions == [2, 1]
    assert run(pipetrain.GPipe(microbatches=2), 2).weight_versions == [1, 1]


def test_the_policy_refuses_an_order_that_breaks_double_buffering():
    """The runtime's check: a minibatch whose version is gone is an error, not a silent other version."""
    policy = DoubleBuffered(torch.nn.Linear(2, 2))
    policy.begin(1)
    w0 = policy.forward_weights(0, None)
    assert policy.forward_weights(1, None) is w0  # minibatches 0 and 1 both run at version 0
    for mb in (0, 1):
        policy.after_backward(mb)
        policy.updated(1)
    assert policy.peak_versions == 2
    policy.forward_weights(2, None)  # at version 1, the one before the newest: kept
    assert policy.version_of(2, None) == 1
    policy.after_backward(2)
    for _ in range(2):
        policy.updated(1)
    with pytest.raises(AssertionError, match=r"minibatch 3 needs weight version 2; this stage holds \[3, 4\]"):
        policy.forward_weights(3, None)
    assert policy.peak_versions == 2
