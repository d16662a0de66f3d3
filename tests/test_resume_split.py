"""Checkpoints keyed by the model's own names: a run saved on one split or strategy resumes on another,
exactly, against plain minibatch SGD with momentum written out here.

The reference: ``params`` of the whole model in one process; for minibatch t (items [tB, (t+1)B),
``shuffle=False``) the whole model's loss gradient g, then b = g (first step) or b = MU b + g, and
p = p - LR b, as ``torch.optim.SGD(momentum=MU)`` defines it. A tied parameter is one parameter.
"""
import functools
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.runtime import checkpoint
from pipetrain.runtime.restore import load_named, named_state, optimized_names
from test_tied import TiedNet
from test_tied import dataset as tied_data

N_MB, BATCH, LR, MU = 6, 4, 0.05, 0.9


def net() -> nn.Sequential:
    """Four layers, float64; stages=[0, 2] and [0, 1, 3] both cut it, and every [0, 1, 2, 3] stage but
    one (the Tanh) holds weights."""
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 3)).double()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(N_MB * BATCH, 4, generator=g, dtype=torch.float64),
                         torch.randn(N_MB * BATCH, 3, generator=g, dtype=torch.float64))


def reference(model: nn.Module, dataset: TensorDataset, loss_fn, epochs: int) -> dict[str, torch.Tensor]:
    """Minibatch SGD with momentum by hand, as the module docstring says; the model's state afterwards."""
    params = list(model.parameters())
    buffers: list[torch.Tensor | None] = [None] * len(params)
    x_all, y_all = dataset.tensors
    for _ in range(epochs):
        for t in range(len(x_all) // BATCH):
            x, y = x_all[t * BATCH:(t + 1) * BATCH], y_all[t * BATCH:(t + 1) * BATCH]
            grads = torch.autograd.grad(loss_fn(model(x), y), params)
            with torch.no_grad():
                for i, (p, g) in enumerate(zip(params, grads)):
                    buffers[i] = g.clone() if buffers[i] is None else MU * buffers[i] + g
                    p -= LR * buffers[i]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-9) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == torch.float64
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=tol, msg=k)


PIPE2 = dict(stages=[0, 2], schedule=pipetrain.GPipe(microbatches=2))
PIPE3 = dict(stages=[0, 1, 3], schedule="gpipe")
DDP2 = dict(strategy="ddp", workers=2)
LOOPED = dict(stages=[0, 1, 2, 3], schedule=pipetrain.Interleaved1F1B(microbatches=2), workers=2)  # a file per stage


def train(how: dict, epochs: int, **kw) -> pipetrain.TrainResult:
    args = dict(loss_fn=nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=LR, momentum=MU),
                batch_size=BATCH, epochs=epochs, shuffle=False, seed=4, timeout=60)
    return pipetrain.train(kw.pop("model", None) or net(), kw.pop("dataset", None) or data(), **{**args, **how, **kw})


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved,resumed", [(PIPE2, PIPE3), (PIPE2, DDP2), (DDP2, PIPE3), (LOOPED, PIPE2),
                                           (PIPE2, LOOPED)],
                         ids=["2-stages-to-3", "pipeline-to-ddp", "ddp-to-pipeline", "looped-to-pipeline",
                              "pipeline-to-looped"])
def test_a_run_resumes_exactly_on_another_split_or_strategy(tmp_path, saved: dict, resumed: dict) -> None:
    """Epoch 0 on one layout, epoch 1 resumed on another: each worker finds its tensors and momentum
    buffers by name in whichever files hold them, and the model is two epochs of minibatch SGD."""
    train(saved, 1, checkpoint_dir=tmp_path)
    result = train(resumed, 2, checkpoint_dir=tmp_path, resume=True)
    assert result.epochs_trained == 1
    assert [h["step"] for h in result.history] == list(range(1, 2 * N_MB + 1))  # epoch 0's from the files
    assert_state(result.model.state_dict(), reference(net(), data(), nn.functional.mse_loss, 2))


@pytest.mark.multiprocess
def test_files_another_layout_left_behind_are_not_part_of_a_newer_epoch(tmp_path) -> None:
    """Three files per epoch, then two (the old third rank's files stay in the directory): the newest
    whole epoch is the two-file job's, for a resume, for load_checkpoint and for the history."""
    train(PIPE3, 1, checkpoint_dir=tmp_path)
    two = train(DDP2, 2, checkpoint_dir=tmp_path, resume=True)
    assert sorted(checkpoint.epochs_saved(tmp_path)[2]) == [0]  # rank 2 of the first job, left behind
    assert checkpoint.newest_whole(tmp_path) == 1
    assert_state(pipetrain.load_checkpoint(net(), tmp_path).state_dict(), two.model.state_dict(), tol=0)
    result = train(PIPE2, 3, checkpoint_dir=tmp_path, resume=True)
    assert result.epochs_trained == 1 and [h["step"] for h in result.history] == list(range(1, 3 * N_MB + 1))
    assert_state(result.model.state_dict(), reference(net(), data(), nn.functional.mse_loss, 3))


@pytest.mark.multiprocess
def test_a_damaged_file_is_skipped_on_another_split_too(tmp_path) -> None:
    train(PIPE2, 2, checkpoint_dir=tmp_path)
    f = checkpoint.path(tmp_path, 1, 1)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(PIPE3, 2, checkpoint_dir=tmp_path, resume=True)
    said = [str(w.message) for w in caught if w.category is pipetrain.PipetrainWarning]
    assert len(said) == 1 and said[0].startswith(f"{f} is corrupt") and "skipping epoch 1" in said[0]
    assert [h["epoch"] for h in result.history] == [0] * N_MB + [1] * N_MB  # epoch 1 trained again
    assert_state(result.model.state_dict(), reference(net(), data(), nn.functional.mse_loss, 2))


@pytest.mark.multiprocess
def test_a_tied_parameter_resumes_on_another_split(tmp_path) -> None:
    """Embedding and output layer share E: saved on three stages (the owner holds it and its momentum
    as emb.weight, the output stage a copy as head.weight), resumed on two stages and on data parallelism."""
    tied = dict(dataset=tied_data(), loss_fn=nn.functional.cross_entropy)
    train(dict(stages=[0, 3, 5], schedule="gpipe"), 1, checkpoint_dir=tmp_path / "saved", model=TiedNet(), **tied)
    manifests = [json.loads(checkpoint.manifest_path(tmp_path / "saved", r, 0).read_text()) for r in range(3)]
    assert "emb.weight" in manifests[0]["holds"]["optimizer"] and manifests[2]["holds"]["optimizer"] == []
    assert "head.weight" in manifests[2]["holds"]["model"]
    want = reference(TiedNet(), tied_data(), nn.functional.cross_entropy, 2)
    for i, how in enumerate([dict(stages=[0, 4], schedule="gpipe"), DDP2]):
        shutil.copytree(tmp_path / "saved", tmp_path / f"resumed{i}")
        result = train(how, 2, checkpoint_dir=tmp_path / f"resumed{i}", resume=True, model=TiedNet(), **tied)
        assert result.model.head.weight is result.model.emb.weight
        assert_state(result.model.state_dict(), want)


def _meta(factory):
    with torch.device("meta"):
        return factory()


def _saved(path) -> dict[str, torch.Tensor]:
    files = [path] if path.suffix == ".safetensors" else sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("factory,how,target", [(net, PIPE2, "dir"), (net, DDP2, "one.safetensors"),
                                                (TiedNet, dict(stages=[0, 3, 5], schedule="gpipe"), "dir")],
                         ids=["pipeline", "ddp", "tied"])
def test_save_of_a_meta_model_with_nothing_left_comes_from_the_checkpoint(tmp_path, factory, how, target) -> None:
    """A model built on the meta device is never whole in one process: with every epoch saved, save=
    is written from the checkpoint's files, each tensor once (a tie under its first name), and holds
    what the run itself saved."""
    kw = dict(dataset=tied_data(), loss_fn=nn.functional.cross_entropy) if factory is TiedNet else {}
    train(how, 1, checkpoint_dir=tmp_path / "ckpt", save=tmp_path / "trained" / target, model=_meta(factory), **kw)
    with pytest.warns(pipetrain.PipetrainWarning, match="nothing left to train"):
        done = train(how, 1, checkpoint_dir=tmp_path / "ckpt", resume=True, save=tmp_path / "again" / target,
                     model=_meta(factory), **kw)
    assert done.model is None and done.saved == str(tmp_path / "again" / target)
    got, want = _saved(tmp_path / "again" / target), _saved(tmp_path / "trained" / target)
    assert got.keys() == want.keys() and "head.weight" not in got
    for k in want:
        assert torch.equal(got[k], want[k]), k
    if target == "dir":
        index = json.loads((tmp_path / "again" / target / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(want)


def test_optimizer_state_by_name_loads_into_parameters_in_another_order() -> None:
    """named_state keys Adam's state by name; load_named gives each parameter of an optimizer that got
    them in another order, and in two groups, its own state and its group's hyperparameters."""
    model = net()
    names = [n for n, _ in model.named_parameters()]
    adam = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    adam.step()
    saved = named_state(adam, optimized_names(adam, model))
    assert set(saved["state"]) == set(names) and saved["param_groups"][0]["params"] == names
    params = dict(model.named_parameters())
    order = [["3.bias", "0.weight"], ["2.weight", "0.bias", "3.weight", "2.bias"]]
    again = torch.optim.Adam([{"params": [params[n] for n in group]} for group in order], lr=1.0)
    load_named(again, saved, [n for group in order for n in group])
    for group in again.param_groups:
        assert group["lr"] == 0.01 and group["betas"] == (0.8, 0.9)
    for name, p in params.items():
        for key, value in adam.state[p].items():
            assert torch.equal(again.state[p][key], value), (name, key)


def test_a_checkpoint_keyed_by_position_is_refused_in_one_line(tmp_path) -> None:
    """A version-1 checkpoint (optimizer state by torch's position) cannot be read by name."""
    checkpoint.manifest_path(tmp_path, 0, 0).write_text(json.dumps({"format": checkpoint.FORMAT, "version": 1}))
    with pytest.raises(checkpoint.CheckpointError, match=r"written by an older pipetrain \(checkpoint version 1, "
                                                         r"optimizer state by position; this one reads 2\)") as e:
        checkpoint.resume_epoch(tmp_path, {"model": "0"}, print)
    assert "\n" not in str(e.value)
