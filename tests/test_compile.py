"""Compiled stages (``train(compile=True)``): float64 runs through inductor equal the eager runs with the
same seeds, and plain minibatch SGD written here; a stage that cannot be compiled fails in one line.

Each compiled run costs its workers a few seconds of compilation per graph on a CPU, so the model is
a 2-stage MLP and every case runs 6 minibatches.
"""
import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.runtime import compiled
from pipetrain.runtime.split_backward import fused_backward, input_backward

N_MB, BATCH, LR = 6, 8, 0.05
STAGES = [0, 2]  # layers: Linear, Tanh | Linear, Tanh, Linear


def model() -> nn.Sequential:
    g = torch.Generator().manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return net


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(N_MB * BATCH, 4, generator=g, dtype=torch.float64),
                         torch.randn(N_MB * BATCH, 3, generator=g, dtype=torch.float64))


def run(compile: bool, **kw) -> tuple[dict[str, torch.Tensor], list[float]]:
    result = pipetrain.train(model(), dataset(), loss_fn=nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=LR), batch_size=BATCH, shuffle=False,
                             seed=0, timeout=120, compile=compile, **kw)
    assert [h["step"] for h in result.history] == list(range(1, N_MB + 1))
    return result.model.state_dict(), [h["loss"] for h in result.history]


def sgd_reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain minibatch SGD on the whole model, with tensors: what every flush schedule and ddp compute."""
    params = {k: v.clone() for k, v in model().state_dict().items()}
    x_all, y_all = dataset().tensors
    losses = []
    for t in range(N_MB):
        x, y = x_all[t * BATCH:(t + 1) * BATCH], y_all[t * BATCH:(t + 1) * BATCH]
        w = {k: v.clone().requires_grad_() for k, v in params.items()}
        h = torch.tanh(x @ w["0.weight"].T + w["0.bias"])
        h = torch.tanh(h @ w["2.weight"].T + w["2.bias"])
        loss = ((h @ w["4.weight"].T + w["4.bias"] - y) ** 2).mean()
        grads = torch.autograd.grad(loss, list(w.values()))
        params = {k: v - LR * g for (k, v), g in zip(params.items(), grads)}
        losses.append(float(loss.detach()))
    return params, losses


def assert_same(got: tuple[dict[str, torch.Tensor], list[float]],
                want: tuple[dict[str, torch.Tensor], list[float]]) -> None:
    assert got[0].keys() == want[0].keys()
    for k in want[0]:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=0, atol=1e-9)
    assert got[1] == pytest.approx(want[1], rel=0, abs=1e-9)


CASES = {
    "pipedream": dict(schedule="pipedream", stages=STAGES),  # stashed versions swapped into a compiled stage
    "1f1b-flush+recompute": dict(schedule="1f1b-flush", stages=STAGES, recompute=True),
    "zero-bubble": dict(schedule=pipetrain.ZeroBubble(microbatches=2), stages=STAGES),
    "2bw": dict(schedule=pipetrain.TwoBW(microbatches=2), stages=STAGES),
    "ddp": dict(strategy="ddp", workers=2),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_equals_eager(case: str) -> None:
    got = run(True, **CASES[case])
    assert_same(got, run(False, **CASES[case]))
    if case in ("1f1b-flush+recompute", "ddp"):  # flush schedules and ddp: plain minibatch SGD
        assert_same(got, sgd_reference())


@pytest.mark.multiprocess
def test_reference_differs_from_stale_rule() -> None:
    """The guard: pipedream's weights are not plain SGD's, so the comparison above can tell them apart."""
    got = run(False, **CASES["pipedream"])
    want = sgd_reference()
    assert max((got[0][k] - want[0][k]).abs().max().item() for k in want[0]) > 1e-6


@torch.library.custom_op("pipetrain_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    """An operator without a fake (meta) kernel: eager runs it, dynamo cannot trace through it."""
    return x * 2


class Opaque(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return opaque(x) + 1


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:pipetrain could not run the model on the meta device")  # nor can it, without a fake kernel
def test_stage_that_cannot_compile_fails_in_one_line() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Opaque(), nn.Linear(8, 3)).double()
    with pytest.raises(pipetrain.PipetrainError) as e:
        pipetrain.train(net, dataset(), loss_fn=nn.functional.mse_loss,
                        optimizer=functools.partial(torch.optim.SGD, lr=LR), stages=[0, 2], schedule="1f1b-flush",
                        batch_size=BATCH, timeout=120, compile=True)
    message = str(e.value)
    assert message.startswith("stage 1 (layers 2-3) could not be compiled: operator pipetrain_test.opaque.default "
                              "failed: RuntimeError: There was no fake impl registered"), message
    assert "pass compile=False" in message and "\n" not in message


def test_failing_backend_names_the_stage() -> None:
    def backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> None:
        raise NotImplementedError("aten.tanh has no lowering here")

    stage = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    compiled.compile_stage(stage, "stage 0 (layers 0-1)", backend=backend)
    with pytest.raises(compiled.CompileError, match=r"^stage 0 \(layers 0-1\) could not be compiled: "
                                                    r"NotImplementedError: aten.tanh has no lowering here; pass "
                                                    r"compile=False to run it eagerly$"):
        stage(torch.randn(2, 4))


def test_compile_is_refused_up_front_where_dynamo_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(ValueError, match=r"^compile=True: this torch .* has no torch.compile \(dynamo\) support for "
                                         r"this Python or platform; pass compile=False$"):
        run(True, **CASES["pipedream"])
    with pytest.raises(ValueError, match=r"compile='yes' must be True"):
        run("yes", **CASES["pipedream"])  # type: ignore[arg-type]


def test_weights_swapped_into_a_compiled_stage_recompile_once() -> None:
    """Stashed copies are graph inputs: new values never recompile, and neither do new copies after
    the first (a plain tensor, where the live weights are parameters); the values used are the copies'."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    stage = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()
    compiled.compile_stage(stage, "stage 0", backend="eager")
    x = torch.randn(3, 4, dtype=torch.float64)
    stage(x)
    for k in range(3):
        copy = {n: p.detach().clone().add_(k).requires_grad_() for n, p in stage.named_parameters()}
        got = torch.func.functional_call(stage, copy, (x,))
        torch.testing.assert_close(got, torch.tanh(x @ copy["0.weight"].T + copy["0.bias"]), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 2


def test_fused_backward_gives_the_split_backwards_gradients() -> None:
    """Zero-bubble's I then W on a compiled stage: every gradient taken at I, the weights' added at W,
    equal to the eager split backward's."""
    def grads(split, compile: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        stage = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        if compile:
            compiled.compile_stage(stage, "stage 1", backend="aot_eager")
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        out = stage(x)
        (gx,), weights = split([out], [torch.ones_like(out)], [x])
        assert all(p.grad is None for p in stage.parameters())
        weights.run()
        return [gx, *(p.grad for p in stage.parameters())]

    for got, want in zip(grads(fused_backward, True), grads(input_backward, False)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.multiprocess  # inductor runs the C++ compiler
def test_profiler_times_compiled_layers_and_their_compilation_apart() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    net = nn.Sequential(*model(), *[nn.Tanh() for _ in range(8)])  # more layers sharing code than dynamo caches
    x, y = dataset().tensors
    profile = pipetrain.profile(net, (x[:BATCH], y[:BATCH]), nn.functional.mse_loss, repeats=2, warmup=1,
                                compile=True)
    eager = pipetrain.profile(net, (x[:BATCH], y[:BATCH]), nn.functional.mse_loss, repeats=2, warmup=1)
    assert profile.meta["compiled"] and "compiled" not in eager.meta
    step_s = sum(layer.forward_s + layer.backward_s for layer in profile.layers)
    assert profile.meta["compile_s"] > 10 * step_s  # compiling takes seconds; a step of this MLP, microseconds
    assert [layer.name for layer in profile.layers] == [layer.name for layer in eager.layers]
    assert counters["stats"]["unique_graphs"] >= len(profile.layers)  # none ran eagerly past dynamo's cache limit


@pytest.mark.multiprocess  # inductor runs the C++ compiler
def test_a_pipedream_stage_compiles_once_however_many_minibatches() -> None:
    """The worker's own code path (stashed copies swapped in each update, an input stage's stash of
    several versions): one graph for its forwards, however many minibatches, with no recompile."""
    from torch._dynamo.utils import counters

    from pipetrain.config import JobConfig, RunOptions, Training
    from pipetrain.layout import Layout
    from pipetrain.registry import as_schedule, as_strategy
    from pipetrain.runtime.solo import run_stage_alone

    training = Training(model=model(), dataset=dataset(), loss_fn=nn.functional.mse_loss,
                        optimizer=functools.partial(torch.optim.SGD, lr=LR), batch_size=BATCH, shuffle=False,
                        compile=True)
    cfg = JobConfig(training, RunOptions(threads=1), as_strategy("pipeline"), as_schedule("pipedream"),
                    Layout.pipeline(STAGES))
    torch._dynamo.reset()
    counters.clear()
    records = run_stage_alone(cfg, 0, N_MB)
    assert sum(text.startswith("F") for text, _, _ in records) == N_MB
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["frames"]["total"] == 1  # compiled once: no guard failed afterwards



def test_cli_passes_compile_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pipetrain train --compile`` is ``train(compile=True)`` (what that runs is tested above)."""
    import pipetrain.cli.train as cli_train
    from pipetrain.cli import build_parser

    class Stop(Exception):
        pass

    def fake_train(*args: object, **kw: object) -> None:
        raise Stop(kw["compile"])

    monkeypatch.setattr(cli_train, "train", fake_train)
    for flags, want in (([], False), (["--compile"], True)):
        args = build_parser().parse_args(["train", "examples.mlp_job:model", "--data", "examples.mlp_job:data",
                                          "--stages", "0,4", "--loss", "mse_loss", *flags])
        with pytest.raises(Stop) as e:
            cli_train.cmd_train(args)
        assert e.value.args == (want,)
