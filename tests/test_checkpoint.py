"""Per-stage checkpoints: saved every epoch, resumed from the newest epoch all stages completed."""
import functools

import pytest
import torch
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.runtime import checkpoint
from pt_models import mlp


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
    assert state["layers"] == [2, 3] and state["epoch"] == 2 and "momentum_buffer" in str(state["optimizer"])


def test_resume_continues_exactly(tmp_path):
    straight = train(epochs=3)
    train(epochs=2, checkpoint_dir=tmp_path)
    resumed = train(epochs=3, checkpoint_dir=tmp_path, resume=True)
    assert [h["epoch"] for h in resumed.history] == [2] * 8
    assert_same_model(resumed.model, straight.model)


def test_resume_uses_the_newest_epoch_all_stages_completed(tmp_path):
    train(epochs=2, checkpoint_dir=tmp_path)
    checkpoint.path(tmp_path, 3, 1).unlink()  # the output stage died before saving epoch 1
    assert checkpoint.latest_common_epoch(tmp_path, 4) == 0
    resumed = train(epochs=2, checkpoint_dir=tmp_path, resume=True)
    assert [h["epoch"] for h in resumed.history] == [1] * 8
    assert_same_model(resumed.model, train(epochs=2).model)


def test_resume_with_other_stages_is_refused(tmp_path):
    """Checked before any worker starts: a one-line ValueError."""
    train(epochs=1, checkpoint_dir=tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="holds layers .* resume with the same stages"):
        train(epochs=2, checkpoint_dir=tmp_path, resume=True, stages=[0, 1, 4, 6])


def test_keep_all_and_assemble_any_epoch(tmp_path):
    result = train(epochs=3, checkpoint_dir=tmp_path, keep_checkpoints=None)
    assert {r: sorted(e) for r, e in checkpoint.epochs_saved(tmp_path).items()} == {r: [0, 1, 2] for r in range(4)}
    assert_same_model(pipetrain.load_checkpoint(mlp(), tmp_path), result.model)
    first = pipetrain.load_checkpoint(mlp(), tmp_path, epoch=0)
    assert_same_model(first, train(epochs=1).model)
    with pytest.raises(ValueError, match="keep at least 2"):
        train(checkpoint_dir=tmp_path, keep_checkpoints=1)
