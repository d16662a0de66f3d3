"""zero-bubble (ZB-H1): the backward split into I (input gradient) and W (weight gradient).

The schedule's order against one written out by hand, its memory and ordering rules, the validator's
refusals, the split backward's arithmetic against one backward, the simulator's bubble against
1f1b-flush's, and float64 runs of 2 and 3 stages against plain minibatch SGD written here.
"""
import functools
import json

import pytest
import torch
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.profiling.profile import LayerProfile, Profile
from pipetrain.registry import from_options, schedule_of
from pipetrain.runtime.split_backward import input_backward
from pipetrain.schedule import Action, Schedule, ScheduleError, validate
from pipetrain.simresult import Link
from pipetrain.trace import draw_timeline, write_chrome_trace
from pt_models import SIZES, mlp

# ZB-H1 for 4 stages and 8 microbatches (one minibatch), compute only; k stands for microbatch 0.k
EXPECTED = [
    "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
    "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
    "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
    "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7",
]


def zb(n: int, m: int, minibatches: int = 1) -> Schedule:
    return pipetrain.build_schedule(pipetrain.ZeroBubble(microbatches=m), [1] * n, minibatches)


def test_text_form_shows_i_and_w_and_round_trips():
    assert Action.parse("I3.1") == Action("I", 3, 1) and str(Action("W", 3, 1)) == "W3.1"
    assert str(Action.parse("W3")) == "W3"
    s = zb(3, 2, 2)
    text = s.to_text()
    assert "I0.1 SB0.1" in text and "W1.0" in text
    assert Schedule.from_text(text) == s


def test_order_is_zb_h1():
    s = zb(4, 8)
    compute = [[a for a in acts if a.kind in "FIW"] for acts in s.actions]
    assert compute == [[Action(t[0], 0, int(t[1:])) for t in row.split()] for row in EXPECTED]
    assert [acts[-1] for acts in s.actions] == [Action("U", 0)] * 4


@pytest.mark.parametrize("n,m", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (5, 3), (6, 12)])
def test_valid_and_holds_what_1f1b_holds(n, m):
    s = zb(n, m, minibatches=3)
    validate(s)
    for w, acts in enumerate(s.actions):
        for mb in range(3):
            pos = {(a.kind, a.micro or 0): i for i, a in enumerate(acts) if a.mb == mb}
            # microbatches whose forward ran and whose I (W) has not: 1F1B's n - s for I, its most (n) for W
            for i in range(len(acts)):
                held_i = sum(pos[("F", k)] <= i < pos[("I", k)] for k in range(m))
                held_w = sum(pos[("F", k)] <= i < pos[("W", k)] for k in range(m))
                assert held_i <= min(n - w, m) and held_w <= n
            for k in range(m):
                assert pos[("I", k)] < pos[("W", k)] < pos[("U", 0)]
                if w > 0:  # the gradient goes upstream right after I, not after W
                    assert pos[("SB", k)] == pos[("I", k)] + 1


def test_options_and_names():
    assert schedule_of("zero-bubble", 4) == pipetrain.ZeroBubble(microbatches=4)
    assert from_options("pipeline", "zero-bubble", microbatches=2)[1] == pipetrain.ZeroBubble(microbatches=2)
    with pytest.raises(ValueError, match="microbatches=0 must be an integer >= 1"):
        pipetrain.ZeroBubble(microbatches=0)
    with pytest.raises(ValueError, match="straight pipelines only"):
        pipetrain.build_schedule("zero-bubble", [2, 1], 2)


@pytest.mark.parametrize("edit,error", [
    (lambda t: t.replace("F0.0 I0.0", "F0.0 W0.0 I0.0").replace("W0.0 W0.1", "W0.1"), "runs W0.0 before I0.0"),
    (lambda t: t.replace("I0.0 SB0.0", "SB0.0 I0.0"), "sends SB0.0 before I0.0"),
    (lambda t: t.replace("W0.1 U0", "U0 W0.1"), "updates at U0 before every W"),
    (lambda t: t.replace(" W0.1 U0", " U0"), "one W for each I"),
])
def test_validator_refuses_split_backwards_out_of_order(edit, error):
    text = zb(2, 2).to_text()
    assert "w1: RF0.0 F0.0 I0.0 SB0.0 RF0.1 F0.1 I0.1 SB0.1 W0.0 W0.1 U0" in text
    with pytest.raises(ScheduleError, match=error):
        validate(Schedule.from_text(edit(text)))


def _graph(kind: str):
    """A small float64 stage: (outputs, their gradients, received input leaves, weights)."""
    g = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randn(a, b, generator=g, dtype=torch.float64, requires_grad=True) for a, b in ((4, 5), (3, 4)))
    b2 = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64).requires_grad_(kind != "first")
    h = torch.tanh(x.clone() @ w1.T)
    out = h @ w2.T + b2
    if kind == "residual":
        out = out + h[:, :3] * b2
    if kind == "reused":  # w2 read twice: both reads' gradients add up
        out = out + torch.tanh(out) @ w2[:, :3].T
    if kind == "constant":  # an output term the input does not reach
        out = out + w1.sum()
    return [out], [torch.randn(6, 3, generator=g, dtype=torch.float64)], [x] if kind != "first" else [], [w1, w2, b2]


@pytest.mark.parametrize("kind", ["chain", "residual", "reused", "constant", "first"])
def test_split_backward_gives_one_backwards_gradients(kind):
    roots, grads, inputs, weights = _graph(kind)
    want = torch.autograd.grad(roots, inputs + weights, grads, retain_graph=True)
    got, part = input_backward(roots, grads, inputs)
    assert all(w.grad is None for w in weights)  # I leaves the weights alone
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-12)
    part.run()
    for w, ref in zip(weights, want[len(inputs):]):
        torch.testing.assert_close(w.grad, ref, rtol=0, atol=1e-12)
    assert all(x.grad is None for x in inputs)


def _idle(result) -> list[float]:
    """Per worker, seconds within the minibatch not computing (F, B, I, W)."""
    return [result.makespan_s - sum(e - s for t, s, e in lane if Action.parse(t).kind in "FBIW")
            for lane in result.trace]


def test_simulated_bubble_is_a_third_of_1f1b_flush(tmp_path):
    """Equal stages, forward 1, backward 2 (I 1, W 1), n = 4, m = 8: 1F1B idles (n - 1)(F + B) = 9
    microbatch units per stage, ZB-H1 (n - 1)(F + I - W) = 3."""
    n, m = 4, 8
    profile = Profile([LayerProfile(str(k), 1.0, 2.0, 8, 8, 0.0, 1.0) for k in range(n)], 1, "cpu", input_bytes=8)
    flush, zero = (pipetrain.simulate(pipetrain.build_schedule(s, [1] * n, 1), profile, list(range(n)), Link())
                   for s in (pipetrain.OneFOneBFlush(microbatches=m), pipetrain.ZeroBubble(microbatches=m)))
    unit = 1.0 / m
    assert _idle(flush) == pytest.approx([9 * unit] * n)
    assert _idle(zero) == pytest.approx([3 * unit] * n)
    assert max(_idle(zero)) <= max(_idle(flush)) / 3 + 1e-12
    assert flush.bubble_fraction == pytest.approx(9 / 33) and zero.bubble_fraction == pytest.approx(3 / 27)
    # activations are held until W: a later stage holds more than under 1F1B, none more than its stage 0
    assert zero.peak_activation_bytes[0] == flush.peak_activation_bytes[0] == max(zero.peak_activation_bytes)
    assert zero.peak_activation_bytes[1] > flush.peak_activation_bytes[1]
    draw_timeline(zero.trace, tmp_path / "zb.png")
    write_chrome_trace(zero.trace, tmp_path / "zb.json")
    cats = {e.get("cat") for e in json.loads((tmp_path / "zb.json").read_text())["traceEvents"]}
    assert {"input gradient", "weight gradient"} <= cats and (tmp_path / "zb.png").stat().st_size > 0


def test_profile_weight_part_loads_old_and_new_json():
    old = {"format": "pipetrain-profile", "version": 1, "batch_size": 4, "device": "cpu",
           "layers": [{"name": "0", "forward_s": 1.0, "backward_s": 2.0, "activation_bytes": 8, "parameter_bytes": 8}]}
    layer = Profile.from_dict(old).layers[0]
    assert layer.weight_backward_s is None and layer.weight_s == 1.0
    assert "weight_backward_s" not in Profile.from_dict(old).to_dict()["layers"][0]
    new = {**old, "layers": [{**old["layers"][0], "weight_backward_s": 0.5}]}
    again = Profile.from_dict(Profile.from_dict(new).to_dict())
    assert again.layers[0].weight_backward_s == 0.5 and again.layers[0].weight_s == 0.5


def test_profiler_measures_the_weight_part():
    x = torch.randn(16, SIZES[0], dtype=torch.float64)
    prof = pipetrain.profile(mlp(), (x, torch.randn(16, SIZES[-1], dtype=torch.float64)),
                             torch.nn.functional.mse_loss, repeats=3, warmup=1)
    for k, layer in enumerate(prof.layers):
        assert layer.weight_backward_s is not None and 0 <= layer.weight_backward_s <= layer.backward_s
        if k % 2:  # Tanh: no weights
            assert layer.weight_backward_s == 0.0
    assert prof.layers[0].weight_backward_s > 0  # the first layer: no input gradient, all of it is W


BATCH, LR, N_MB = 4, 0.05, 6


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(N_MB * BATCH, SIZES[0], generator=g, dtype=torch.float64),
                         torch.randn(N_MB * BATCH, SIZES[-1], generator=g, dtype=torch.float64))


def _plain_sgd() -> list[torch.Tensor]:
    """The whole model, one update per minibatch with its mean gradient, in plain tensors."""
    params = [p.detach().clone() for p in mlp().parameters()]
    x_all, y_all = _data().tensors
    for t in range(N_MB):
        x, y = x_all[t * BATCH:(t + 1) * BATCH], y_all[t * BATCH:(t + 1) * BATCH]
        used = [p.clone().requires_grad_() for p in params]
        h = x
        for i in range(0, len(used), 2):
            h = h @ used[i].T + used[i + 1]
            if i + 2 < len(used):
                h = torch.tanh(h)
        grads = torch.autograd.grad(((h - y) ** 2).mean(), used)
        params = [p - LR * g for p, g in zip(params, grads)]
    return params


@pytest.mark.multiprocess
@pytest.mark.parametrize("stages,m", [([0, 3], 2), ([0, 3], 4), ([0, 2, 4], 2), ([0, 2, 4], 4)])
def test_runs_plain_minibatch_sgd(stages, m):
    result = pipetrain.train(mlp(), _data(), loss_fn=torch.nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=LR), stages=stages,
                             schedule=pipetrain.ZeroBubble(microbatches=m), batch_size=BATCH, shuffle=False,
                             timeout=60, trace=True)
    assert [h["step"] for h in result.history] == list(range(1, N_MB + 1))
    for got, want in zip(result.model.parameters(), _plain_sgd()):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-9)
    kinds = [{Action.parse(t).kind for t, _, _ in lane} for lane in result.traces]
    assert all({"I", "W"} <= k and "B" not in k for k in kinds)
