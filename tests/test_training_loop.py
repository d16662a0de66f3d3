"""The training loop's features on every strategy: learning-rate schedules, gradient clipping,
evaluation with metrics, bf16 autocast and the metrics log, each against a reference written here."""
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.planning import Plan, StagePlan

ROOT = Path(__file__).resolve().parents[1]
BATCH, LR, N_MB = 8, 0.3, 6
SGD = functools.partial(torch.optim.SGD, lr=LR)
STEP_LR = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)


def net(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Dropout(0.3), nn.Linear(7, 7), nn.Tanh(),
                         nn.Linear(7, 3)).to(dtype)


def data(n: int = N_MB * BATCH, seed: int = 2, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=dtype)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def nodrop(model: nn.Sequential) -> nn.Sequential:
    model[2].p = 0.0  # dropout off: the references below are deterministic
    return model


LOSS = nn.functional.cross_entropy
PIPELINE = dict(stages=[0, 3], schedule="model-parallel")  # plain minibatch SGD, weights split in two


def reference(lr_at=lambda t: LR, clip: float | None = None, groups=None, epochs: int = 1) -> nn.Module:
    """Minibatch SGD in order, by hand: update t uses lr_at(t); with ``clip``, the gradient of each
    group of parameter indices (all of them by default) is scaled to norm <= clip on its own."""
    model = nodrop(net())
    params = list(model.parameters())
    x, y = data().tensors
    for t in range(epochs * N_MB):
        rows = slice((t % N_MB) * BATCH, (t % N_MB + 1) * BATCH)
        grads = torch.autograd.grad(LOSS(model(x[rows]), y[rows]), params)
        for group in groups or [range(len(params))]:
            norm = torch.sqrt(sum((grads[i] ** 2).sum() for i in group))
            scale = min(1.0, clip / (norm + 1e-6)) if clip is not None else 1.0
            with torch.no_grad():
                for i in group:
                    params[i] -= lr_at(t) * scale * grads[i]
    return model


def train(**kw):
    args = dict(loss_fn=LOSS, optimizer=SGD, batch_size=BATCH, shuffle=False, timeout=60)
    args.update(kw)
    return pipetrain.train(args.pop("model", None) or nodrop(net()), args.pop("dataset", None) or data(), **args)


def assert_same(model: nn.Module, want: nn.Module) -> None:
    for (k, a), b in zip(model.state_dict().items(), want.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-9), k


LAYOUTS = {"pipeline": PIPELINE, "ddp": dict(strategy="ddp", workers=2),
           "pipe-sgd-sync": dict(strategy=pipetrain.PipeSGD(staleness=1), workers=2)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lr_scheduler_steps_once_per_update_on_every_worker(layout: str) -> None:
    result = train(lr_scheduler=STEP_LR, epochs=2, **LAYOUTS[layout])
    assert_same(result.model, reference(lambda t: LR * 0.5 ** (t // 2), epochs=2))
    assert [h["lr"] for h in result.history] == [LR * 0.5 ** (t // 2) for t in range(2 * N_MB)]


@pytest.mark.multiprocess
def test_clip_grad_norm_is_global_for_data_parallel_and_per_stage_for_a_pipeline() -> None:
    clip = 0.05
    assert_same(train(clip_grad_norm=clip, strategy="ddp", workers=2).model, reference(clip=clip))
    # stage 0 holds Linear 0 (parameters 0, 1), stage 1 Linears 1 and 2 (parameters 2..5)
    per_stage = reference(clip=clip, groups=[range(2), range(2, 6)])
    assert_same(train(clip_grad_norm=clip, **PIPELINE).model, per_stage)
    whole = reference(clip=clip)
    assert any(not torch.allclose(a, b) for a, b in zip(per_stage.parameters(), whole.parameters()))


def evaluate_by_hand(model: nn.Module, dataset: TensorDataset, batch: int) -> dict[str, float]:
    """Mean loss and accuracy over the whole minibatches of ``dataset``, in eval mode."""
    model.eval()
    x, y = dataset.tensors
    n = len(dataset) // batch * batch
    with torch.no_grad():
        out = model(x[:n])
    losses = [LOSS(out[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]
    return {"loss": float(sum(losses) / len(losses)), "accuracy": float((out.argmax(1) == y[:n]).double().mean())}


EVAL_LAYOUTS = {
    "pipedream": dict(stages=[0, 2, 4]),
    "replicated": dict(stages=Plan([StagePlan(0, 2, 2), StagePlan(3, 5, 1)], noam=2, stage_time_s=0.01,
                                   speedup_vs_one=1.0, speedup_vs_dp=1.0)),
    "ddp": dict(strategy="ddp", workers=2),
    "pipe-sgd": dict(strategy="pipe-sgd", workers=3),
    "cgdp": dict(strategy="cgdp", workers=2),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", EVAL_LAYOUTS)
def test_evaluation_after_every_epoch_uses_that_epochs_weights_in_eval_mode(layout: str, tmp_path: Path) -> None:
    batch = 24 if layout == "pipe-sgd" else BATCH  # divisible by the workers
    held_out = data(3 * batch + 5, seed=9)  # 3 whole minibatches and a tail of 5, left out
    result = train(model=net(), eval_dataset=held_out, metrics={"accuracy": pipetrain.accuracy}, epochs=2,
                   batch_size=batch, log_dir=tmp_path, **EVAL_LAYOUTS[layout])
    evals = [(h["step"], h["eval"]) for h in result.history if h["eval"] is not None]
    steps = len(result.history) // 2
    assert [s for s, _ in evals] == [steps, 2 * steps]
    assert evals[-1][1] == pytest.approx(evaluate_by_hand(result.model, held_out, batch), rel=1e-12)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "update"] == list(range(1, 2 * steps + 1))
    assert [(r["step"], r["accuracy"]) for r in records if r["kind"] == "eval"] == \
        [(s, e["accuracy"]) for s, e in evals]


@pytest.mark.multiprocess
def test_bf16_autocasts_the_forward_of_every_stage() -> None:
    """The pipeline in bf16 is the whole model's SGD under autocast: only the compute is bfloat16."""
    model, dataset = nodrop(net(torch.float32)), data(dtype=torch.float32)
    result = train(model=model, dataset=dataset, precision="bf16", **PIPELINE)
    ref = nodrop(net(torch.float32))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    x, y = dataset.tensors
    for t in range(N_MB):
        rows = slice(t * BATCH, (t + 1) * BATCH)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = LOSS(ref(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    fp32 = train(model=nodrop(net(torch.float32)), dataset=dataset, **PIPELINE).model
    for a, b, c in zip(result.model.parameters(), ref.parameters(), fp32.parameters()):
        assert a.dtype == torch.float32
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert max((a - c).abs().max() for a, c in zip(result.model.parameters(), fp32.parameters())) > 1e-4


@pytest.mark.multiprocess
def test_resume_keeps_the_schedulers_place(tmp_path: Path) -> None:
    kw = dict(lr_scheduler=STEP_LR, checkpoint_dir=tmp_path, **PIPELINE)
    train(epochs=1, **kw)
    resumed = train(epochs=2, resume=True, **kw)
    assert_same(resumed.model, reference(lambda t: LR * 0.5 ** (t // 2), epochs=2))
    assert [h["lr"] for h in resumed.history] == [LR * 0.5 ** (t // 2) for t in range(2 * N_MB)]


@pytest.mark.parametrize("kw, message", [
    (dict(lr_scheduler=3), r"lr_scheduler=3 is not callable; pass a factory taking the optimizer"),
    (dict(clip_grad_norm=0), r"clip_grad_norm=0: give the largest gradient norm, a number > 0"),
    (dict(precision="fp16"), r"precision='fp16': use one of 'fp32', 'bf16'"),
    (dict(metrics={"accuracy": pipetrain.accuracy}), r"metrics are computed on eval_dataset; give eval_dataset too"),
    (dict(eval_dataset=data(3)), r"eval_dataset has 3 items, fewer than one minibatch of 8"),
    (dict(eval_dataset=[1, 2]), r"eval_dataset's items must be \(input, target\) pairs or dictionaries, but item 0 is a int"),
    (dict(eval_dataset=data(), metrics={"loss": LOSS}), r"metrics: 'loss' is reported already"),
    (dict(log_dir=__file__), r"log_dir '.*test_training_loop.py' is not usable"),
])
def test_bad_training_loop_options(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        train(**PIPELINE, **kw)


@pytest.mark.multiprocess
def test_cli_trains_with_evaluation_and_plots_the_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pipetrain.cli"]
    r = subprocess.run([*cmd, "train", "tests.test_training_loop:net", "--data", "tests.test_training_loop:data",
                        "--eval-data", "tests.test_training_loop:data", "--metrics", "accuracy", "--loss",
                        "cross_entropy", "--stages", "0,3", "--batch-size", "8", "--epochs", "2", "--log-dir",
                        str(tmp_path), "--clip-grad-norm", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "epoch 1: held-out loss" in r.stderr + r.stdout
    final = r.stdout.split("final loss ")[1].split()[0]
    assert f"loss={final}]" in r.stderr  # the bar ends on the last update's loss (its postfix waits for a redraw)
    r = subprocess.run([*cmd, "plot", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (tmp_path / "metrics.png").stat().st_size > 10_000, r.stderr
