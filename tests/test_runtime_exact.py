"""Exactness: 4 stages in float64, 12 minibatches of SGD, against an independent reference.

The reference keeps every stage's weights after k updates, W_s[k], and for minibatch t (1-based) takes
the gradient of the whole network's loss with stage s running at version v_s(t):
  pipedream (weight stashing):      v_s(t) = max(0, t-1-(n-s))   (stage 1 is n-1 updates stale)
  pipedream + vertical sync:        v_s(t) = max(0, t-1-(n-1))   for every s
  gpipe / 1f1b-flush / model-parallel: v_s(t) = t-1               (plain minibatch SGD)
then W_s[t] = W_s[t-1] - lr * grad_s.
"""
import functools
import math

import pytest
import torch
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.planning import Plan, StagePlan
from pt_models import SIZES, Residual, mlp

N_STAGES, N_MB, BATCH, LR = 4, 12, 4, 0.05
STAGES = [0, 2, 4, 6]


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_MB * BATCH, SIZES[0], generator=g, dtype=torch.float64)
    y = torch.randn(N_MB * BATCH, SIZES[-1], generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def reference(version, replicas=(1, 1, 1, 1)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain-tensor SGD where stage s (1-based) computes minibatch t at weights W_s[version(s, t)].

    A stage with r replicas makes one update per r minibatches, with their mean gradient.
    """
    model = mlp()
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    hist = [[(l.weight.detach().clone(), l.bias.detach().clone())] for l in linears]
    pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(N_STAGES)]
    x_all, y_all = dataset().tensors
    for t in range(1, N_MB + 1):
        x, y = x_all[(t - 1) * BATCH:t * BATCH], y_all[(t - 1) * BATCH:t * BATCH]
        used = [tuple(p.clone().requires_grad_() for p in hist[s][version(s + 1, t)]) for s in range(N_STAGES)]
        h = x
        for s, (w, b) in enumerate(used):
            h = h @ w.T + b
            if s < N_STAGES - 1:
                h = torch.tanh(h)
        loss = ((h - y) ** 2).mean()
        grads = torch.autograd.grad(loss, [p for pair in used for p in pair])
        for s in range(N_STAGES):
            pending[s].append((grads[2 * s], grads[2 * s + 1]))
            if len(pending[s]) == replicas[s]:
                w, b = hist[s][-1]
                gw = sum(g for g, _ in pending[s]) / replicas[s]
                gb = sum(g for _, g in pending[s]) / replicas[s]
                hist[s].append((w - LR * gw, b - LR * gb))
                pending[s].clear()
    return [h[-1] for h in hist]


def run(schedule: str | pipetrain.registry.PipelineSchedule, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    args = dict(loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                stages=STAGES, schedule=schedule, batch_size=BATCH, epochs=1, shuffle=False, seed=0, timeout=60)
    result = pipetrain.train(mlp(), dataset(), **{**args, **kw})
    assert [h["step"] for h in result.history] == list(range(1, N_MB + 1))
    if schedule in ("model-parallel", pipetrain.ModelParallel()):  # activations (B x 6 float64) forward, same-sized gradients back
        cut = BATCH * 6 * 8 * N_MB
        assert result.bytes_sent == [cut, 2 * cut, 2 * cut, cut]
    return [(m.weight.detach(), m.bias.detach()) for m in result.model if isinstance(m, torch.nn.Linear)]


def assert_same(got, want, tol=1e-9):
    for (gw, gb), (ww, wb) in zip(got, want):
        torch.testing.assert_close(gw, ww, rtol=0, atol=tol)
        torch.testing.assert_close(gb, wb, rtol=0, atol=tol)


def stashed(s: int, t: int) -> int:
    return max(0, t - 1 - (N_STAGES - s))


def vertical(s: int, t: int) -> int:
    return max(0, t - 1 - (N_STAGES - 1))


def plain(s: int, t: int) -> int:
    return t - 1


@pytest.mark.multiprocess
def test_pipedream_weight_stashing_is_exact():
    assert_same(run("pipedream"), reference(stashed))


@pytest.mark.multiprocess
def test_vertical_sync_is_exact():
    assert_same(run(pipetrain.PipeDream(vertical_sync=True)), reference(vertical))


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", [pipetrain.GPipe(microbatches=2), pipetrain.OneFOneBFlush(microbatches=4),
                                      pipetrain.ModelParallel()], ids=str)
def test_flush_schedules_are_plain_minibatch_sgd(schedule):
    assert_same(run(schedule), reference(plain))


def test_the_three_semantics_really_differ():
    """Guards the tests above: the references are not accidentally equal."""
    refs = [reference(stashed), reference(vertical), reference(plain)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert (refs[i][0][0] - refs[j][0][0]).abs().max() > 1e-6


@pytest.mark.multiprocess
def test_naive_differs_from_every_consistent_rule():
    got = run("naive")
    for rule in (stashed, vertical, plain):
        assert max((g[0] - w[0]).abs().max().item() for g, w in zip(got, reference(rule))) > 1e-6


@pytest.mark.multiprocess
def test_branchy_fx_model_trains_like_local_sgd():
    """An fx model cut inside a residual block (two tensors cross) matches single-process SGD."""
    ds = dataset()
    result = pipetrain.train(Residual().double(), ds, loss_fn=torch.nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=LR), stages=[0, 2, 4],
                             schedule="model-parallel", batch_size=BATCH, shuffle=False, timeout=60)
    ref = Residual().double()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    x_all, y_all = ds.tensors
    for t in range(N_MB):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x_all[t * BATCH:(t + 1) * BATCH]), y_all[t * BATCH:(t + 1) * BATCH]).backward()
        opt.step()
    for (k, v), (k2, v2) in zip(result.model.state_dict().items(), ref.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, v2, rtol=0, atol=1e-9)


@pytest.mark.multiprocess
def test_replicated_stage_is_exact():
    """Stages on 2, 1, 1, 1 workers (stage 1 replicated): the update rule of a replicated stage.

    With r replicas and warm-up w = ceil(workers in stages s.. / r), minibatch t (1-based) is computed
    at the stage's weights after max(0, (t-1)//r - w + 1) updates, and each update is the mean of r
    consecutive minibatches' gradients. Here w = ceil(5/2) = 3 for the replicated stage, then 3, 2, 1.
    """
    replicas = (2, 1, 1, 1)
    warm = [math.ceil(sum(replicas[s:]) / replicas[s]) for s in range(N_STAGES)]

    def rule(s: int, t: int) -> int:
        return max(0, (t - 1) // replicas[s - 1] - warm[s - 1] + 1)

    layout = Plan([StagePlan(0, 1, 2), StagePlan(2, 3, 1), StagePlan(4, 5, 1), StagePlan(6, 6, 1)],
                  noam=3, stage_time_s=1.0, speedup_vs_one=1.0, speedup_vs_dp=1.0)
    assert_same(run("pipedream", stages=layout), reference(rule, replicas))
    assert max((a[0] - b[0]).abs().max().item() for a, b in zip(reference(rule, replicas), reference(stashed))) > 1e-6


@pytest.mark.multiprocess
def test_the_callers_model_is_left_alone():
    """Workers train copies: the model passed in keeps its weights (no worker shares its memory)."""
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipetrain.train(model, dataset(), loss_fn=torch.nn.functional.mse_loss,
                    optimizer=functools.partial(torch.optim.SGD, lr=LR), stages=STAGES, batch_size=BATCH,
                    shuffle=False, timeout=60)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
