"""Tied parameters across stages, in float64 against an independent reference.

The model: token ids -> embedding E -> linear A -> tanh -> linear C -> tanh -> output layer whose weight
is E (tied) -> mean over positions. Three stages: [E, A, tanh] [C, tanh] [E^T, mean], so the input and
the output stage both read E.

The reference keeps every version of each stage's own weights and of E. Minibatch t (1-based) takes the
whole network's gradient with stage s (1-based, of n) at version v_s(t) and E at version e(t):
  pipedream:                        v_s(t) = max(0, t-1-(n-s)),  e(t) = max(0, t-n)
  pipedream + vertical sync:        v_s(t) = e(t) = max(0, t-n)
  2bw:                              v_s(t) = e(t) = max(0, t-2)
  gpipe / 1f1b-flush / model-parallel and data parallelism: v_s(t) = e(t) = t-1  (plain SGD)
and update t applies minibatch t's gradient; E's is the sum over both uses (autograd adds them).
"""
import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.planning import Plan, StagePlan

VOCAB, WIDTH, SEQ, N_MB, BATCH, LR = 11, 6, 3, 8, 4, 0.2
STAGES = [0, 3, 5]


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Embedding(VOCAB, WIDTH, dtype=torch.float64)
        self.a = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        self.c = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False, dtype=torch.float64)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.c(torch.tanh(self.a(self.emb(x)))))).mean(1)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randint(0, VOCAB, (N_MB * BATCH, SEQ), generator=g),
                         torch.randint(0, VOCAB, (N_MB * BATCH,), generator=g))


def reference(own, tied, clip=None) -> dict[str, torch.Tensor]:
    """Plain-tensor SGD with stage s at its own version own(s, t) and E at tied(t); ``clip`` clips each
    stage's gradient (E counted once, at the input stage) by its norm."""
    net = TiedNet()
    stage_params = [["a.weight", "a.bias"], ["c.weight", "c.bias"], []]
    hist = [[{k: net.state_dict()[k].clone() for k in names}] for names in stage_params]
    emb = [net.emb.weight.detach().clone()]
    x_all, y_all = dataset().tensors
    for t in range(1, N_MB + 1):
        x, y = x_all[(t - 1) * BATCH:t * BATCH], y_all[(t - 1) * BATCH:t * BATCH]
        w = [{k: v.clone().requires_grad_() for k, v in hist[s][own(s + 1, t)].items()} for s in range(3)]
        e = emb[tied(t)].clone().requires_grad_()
        h = torch.tanh(e[x] @ w[0]["a.weight"].T + w[0]["a.bias"])
        h = torch.tanh(h @ w[1]["c.weight"].T + w[1]["c.bias"])
        loss = nn.functional.cross_entropy((h @ e.T).mean(1), y)
        leaves = [e] + [p for s in range(2) for p in w[s].values()]
        grads = dict(zip(["e", "a.weight", "a.bias", "c.weight", "c.bias"], torch.autograd.grad(loss, leaves)))
        if clip is not None:
            for group in (["e", "a.weight", "a.bias"], ["c.weight", "c.bias"]):
                norm = torch.sqrt(sum((grads[k] ** 2).sum() for k in group))
                scale = min(1.0, clip / (float(norm) + 1e-6))
                for k in group:
                    grads[k] = grads[k] * scale
        for s in range(3):
            hist[s].append({k: v - LR * grads[k] for k, v in hist[s][-1].items()})
        emb.append(emb[-1] - LR * grads["e"])
    return {"emb.weight": emb[-1], **hist[0][-1], **hist[1][-1]}


def train(**kw) -> nn.Module:
    args = dict(loss_fn=nn.functional.cross_entropy, optimizer=functools.partial(torch.optim.SGD, lr=LR),
                stages=STAGES, batch_size=BATCH, epochs=1, shuffle=False, timeout=60)
    result = pipetrain.train(TiedNet(), dataset(), **{**args, **kw})
    assert [h["step"] for h in result.history] == list(range(1, N_MB * kw.get("epochs", 1) + 1))
    model = result.model
    assert model.head.weight is model.emb.weight  # the returned model keeps the tie
    return model


def assert_matches(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-9)


def plain(s, t):
    return t - 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", pipetrain.GPipe(microbatches=2), pipetrain.OneFOneBFlush(microbatches=2),
                                      pipetrain.ZeroBubble(microbatches=2), "model-parallel"])
def test_flush_schedules_are_plain_sgd_of_the_tied_model(schedule) -> None:
    assert_matches(train(schedule=schedule), reference(plain, lambda t: t - 1))


@pytest.mark.multiprocess
def test_pipedream_reads_the_tied_parameter_at_the_input_stage_version() -> None:
    n = len(STAGES)
    want = reference(lambda s, t: max(0, t - 1 - (n - s)), lambda t: max(0, t - n))
    assert_matches(train(schedule="pipedream"), want)


@pytest.mark.multiprocess
def test_vertical_sync_reads_everything_at_the_input_stage_version() -> None:
    n = len(STAGES)
    want = reference(lambda s, t: max(0, t - n), lambda t: max(0, t - n))
    assert_matches(train(schedule=pipetrain.PipeDream(vertical_sync=True)), want)


@pytest.mark.multiprocess
def test_2bw_reads_everything_one_update_stale() -> None:
    want = reference(lambda s, t: max(0, t - 2), lambda t: max(0, t - 2))
    assert_matches(train(schedule=pipetrain.TwoBW(microbatches=4)), want)


@pytest.mark.multiprocess
def test_clipping_counts_the_tied_parameter_once() -> None:
    want = reference(plain, lambda t: t - 1, clip=0.05)
    assert_matches(train(schedule="gpipe", clip_grad_norm=0.05), want)


@pytest.mark.multiprocess
def test_data_parallel_keeps_the_tie() -> None:
    result = pipetrain.train(TiedNet(), dataset(), loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=LR), strategy="ddp", workers=2,
                             batch_size=BATCH, epochs=1, shuffle=False, timeout=60)
    assert result.model.head.weight is result.model.emb.weight
    assert_matches(result.model, reference(plain, lambda t: t - 1))


@pytest.mark.multiprocess
def test_resume_keeps_the_copies_equal(tmp_path) -> None:
    """Two epochs in one go equal one epoch, then a resumed second (the borrower's copy restored from
    its own checkpoint, the owner's optimizer state from its)."""
    kw = dict(schedule="pipedream", optimizer=functools.partial(torch.optim.SGD, lr=LR, momentum=0.9))
    straight = train(epochs=2, **kw).state_dict()
    train(epochs=1, checkpoint_dir=str(tmp_path), **kw)
    resumed = train(epochs=2, checkpoint_dir=str(tmp_path), resume=True, **kw).state_dict()
    for k, v in straight.items():
        torch.testing.assert_close(resumed[k], v, rtol=0, atol=0)


def test_a_replicated_stage_with_a_tied_parameter_is_refused() -> None:
    plan = Plan([StagePlan(0, 2, 2), StagePlan(3, 4, 1), StagePlan(5, 6, 1)], 0, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"parameter emb.weight is tied across stages \[0, 2\], and stage 0 is "
                                         r"replicated; a tied parameter needs one worker on each stage"):
        pipetrain.train(TiedNet(), dataset(), loss_fn=nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=LR), stages=plan, batch_size=BATCH)


def test_naive_schedule_with_a_tied_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match="parameter emb.weight is tied across stages .* use pipedream"):
        pipetrain.train(TiedNet(), dataset(), loss_fn=nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=LR), stages=STAGES, schedule="naive",
                        batch_size=BATCH)


def test_a_tie_through_submodules_is_found() -> None:
    """``self.head.weight = self.emb.weight``: both layers are module calls, neither an attribute read."""
    layers = pipetrain.layers.LayeredModel(TiedNet())
    assert layers.shared_parameters(STAGES) == {"emb.weight": [0, 2]}
    assert layers.shared_parameters([0, 5]) == {"emb.weight": [0, 1]}
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    seq[2].weight = seq[0].weight
    assert pipetrain.layers.LayeredModel(seq).shared_parameters([0, 2]) == {"0.weight": [0, 1]}


def test_the_profile_knows_which_layers_share_a_parameter() -> None:
    x, y = dataset()[:BATCH]
    profile = pipetrain.profiling.profile_model(TiedNet(), (x, y), nn.functional.cross_entropy, repeats=1, warmup=0)
    layers = pipetrain.layers.LayeredModel(TiedNet())
    assert profile.ties == [([layers.names.index("emb"), layers.names.index("head")], VOCAB * WIDTH * 8)]


def test_the_planner_prices_a_tie_it_would_split() -> None:
    """Layers of 3, 1, 1, 1 ms on 2 workers: the balanced cut is after layer 0, but layers 0 and 1 share
    a parameter whose exchange would take 10 ms, so the plan keeps them on one stage."""
    work = [3e-3, 1e-3, 1e-3, 1e-3]
    layers = [pipetrain.profiling.LayerProfile(str(k), w / 3, 2 * w / 3, 100, 100) for k, w in enumerate(work)]
    plain = pipetrain.profiling.Profile(layers, batch_size=1, device="test")
    tied = pipetrain.profiling.Profile(layers, batch_size=1, device="test", ties=[([0, 1], 10_000_000)])
    assert [s.first_layer for s in pipetrain.planning.plan(plain, 2, 1e9, straight=True).stages] == [0, 1]
    assert [s.first_layer for s in pipetrain.planning.plan(tied, 2, 1e9, straight=True).stages] == [0, 2]
