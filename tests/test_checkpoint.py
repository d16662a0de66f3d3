"""Per-stage checkpoints: saved every epoch with a checksummed manifest, resumed from the newest epoch
every stage completed intact; damaged or foreign checkpoints are skipped or refused in one line."""
import functools
import json
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.runtime import checkpoint
from pt_models import mlp

pytestmark = pytest.mark.multiprocess


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(32, 4, generator=g, dtype=torch.float64),
                         torch.randn(32, 3, generator=g, dtype=torch.float64))


def train(**kw):
    args = dict(loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                stages=[0, 2, 4, 6], batch_size=4, shuffle=True, seed=5, timeout=60)
    return pipetrain.train(mlp(), data(), **{**args, **kw})


def assert_same_model(a, b):
    for (k, v), (k2, v2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, v2, rtol=0, atol=1e-12)


def test_every_stage_saves_each_epoch_and_keeps_two(tmp_path):
    train(epochs=3, checkpoint_dir=tmp_path)
    assert {r: sorted(e) for r, e in checkpoint.epochs_saved(tmp_path).items()} == {r: [1, 2] for r in range(4)}
    state = torch.load(checkpoint.path(tmp_path, 1, 2), weights_only=True)
    assert set(state["model"]) == {"2.weight", "2.bias"}  # stage 1: layers 2-3 (Linear, Tanh)
    assert state["epoch"] == 2 and "momentum_buffer" in str(state["optimizer"])
    assert set(state["optimizer"]["state"]) == {"2.weight", "2.bias"}  # keyed by the model's names
    assert state["optimizer"]["param_groups"][0]["params"] == ["2.weight", "2.bias"]
    manifest = json.loads(checkpoint.manifest_path(tmp_path, 1, 2).read_text())
    assert manifest["holds"] == {"model": ["2.weight", "2.bias"], "optimizer": ["2.weight", "2.bias"], "history": 0}
    assert manifest["job"]["savers"] == 4
    assert manifest["bytes"] == checkpoint.path(tmp_path, 1, 2).stat().st_size
    assert manifest["job"]["layout"] == {"boundaries": [0, 2, 4, 6], "replicas": [1, 1, 1, 1]}
    assert len(state["history"]) == 0 and len(torch.load(checkpoint.path(tmp_path, 3, 2))["history"]) == 3 * 8


def test_resume_continues_exactly(tmp_path):
    straight = train(epochs=3)
    train(epochs=2, checkpoint_dir=tmp_path)
    resumed = train(epochs=3, checkpoint_dir=tmp_path, resume=True)
    # the history is whole: the first two epochs' records come from the checkpoints
    assert [h["step"] for h in resumed.history] == list(range(1, 25))
    assert [h["epoch"] for h in resumed.history] == [0] * 8 + [1] * 8 + [2] * 8
    assert_same_model(resumed.model, straight.model)


def test_resume_uses_the_newest_epoch_all_stages_completed(tmp_path):
    train(epochs=2, checkpoint_dir=tmp_path)
    checkpoint.manifest_path(tmp_path, 3, 1).unlink()  # the output stage died before finishing epoch 1's save
    resumed = train(epochs=2, checkpoint_dir=tmp_path, resume=True)
    assert [h["epoch"] for h in resumed.history] == [0] * 8 + [1] * 8
    assert_same_model(resumed.model, train(epochs=2).model)


@pytest.mark.parametrize("damage,words", [("truncate", "is truncated"), ("flip", "is corrupt")])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, damage, words):
    train(epochs=2, checkpoint_dir=tmp_path)
    f = checkpoint.path(tmp_path, 2, 1)
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2] if damage == "truncate" else data[:-9] + bytes([data[-9] ^ 1]) + data[-8:])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = train(epochs=2, checkpoint_dir=tmp_path, resume=True)
    assert any(str(f) in str(w.message) and words in str(w.message) for w in caught)
    assert [h["epoch"] for h in resumed.history] == [0] * 8 + [1] * 8  # epoch 1 trained again
    assert_same_model(resumed.model, train(epochs=2).model)


@pytest.mark.parametrize("stages,strategy,workers", [([0, 1, 4, 6], "pipeline", None), (None, "ddp", 4)])
def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path, stages, strategy, workers):
    """Checked before any worker starts: a one-line ValueError naming the model, whatever the split
    (another split or strategy of the same model resumes: tests/test_resume_split.py)."""
    train(epochs=1, checkpoint_dir=tmp_path)
    other = torch.nn.Sequential(*list(mlp())[:-1], torch.nn.Linear(6, 3, bias=False)).double()
    args = dict(loss_fn=torch.nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.05),
                stages=stages, strategy=strategy, workers=workers, batch_size=4, epochs=2, timeout=60,
                checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(checkpoint.CheckpointError) as e:
        pipetrain.train(other, data(), **args)
    assert "another job (model: saved" in str(e.value) and "\n" not in str(e.value)


def test_an_unreadable_checkpoint_says_so_in_one_line(tmp_path):
    train(epochs=1, checkpoint_dir=tmp_path)
    checkpoint.path(tmp_path, 0, 0).write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read as a checkpoint .* it is damaged"):
        checkpoint.load(tmp_path, 0, 0)
    with pytest.raises(checkpoint.CheckpointError, match="is not a pipetrain checkpoint manifest"):
        checkpoint.manifest_path(tmp_path, 0, 0).write_text("[]")
        checkpoint.damage(tmp_path, 0, 0)


def test_keep_all_and_assemble_any_epoch(tmp_path):
    result = train(epochs=3, checkpoint_dir=tmp_path, keep_checkpoints=None)
    assert {r: sorted(e) for r, e in checkpoint.epochs_saved(tmp_path).items()} == {r: [0, 1, 2] for r in range(4)}
    assert_same_model(pipetrain.load_checkpoint(mlp(), tmp_path), result.model)
    first = pipetrain.load_checkpoint(mlp(), tmp_path, epoch=0)
    assert_same_model(first, train(epochs=1).model)
    with pytest.raises(ValueError, match="keep at least 2"):
        train(checkpoint_dir=tmp_path, keep_checkpoints=1)
