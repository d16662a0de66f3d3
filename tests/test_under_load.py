"""Busy machines: many workers on few cores, and a slow worker, are not mistaken for dead ones."""
import functools

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.data import regression
from pt_models import BusyOn

pytestmark = pytest.mark.multiprocess

SGD = functools.partial(torch.optim.SGD, lr=0.05)


def deep(width: int = 32, layers: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    body = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers - 1)]
    return nn.Sequential(nn.Linear(4, width), *body[:-1], nn.Linear(width, 3)).double()


@pytest.mark.parametrize("layout", [dict(stages=list(range(8))), dict(strategy="pipe-sgd", workers=8)])
def test_eight_workers_on_two_cores_finish_with_the_default_timeout(layout) -> None:
    result = pipetrain.train(deep(), regression(512, 4, 3), loss_fn=torch.nn.functional.mse_loss, optimizer=SGD,
                             batch_size=16, epochs=2, **layout)
    assert len(result.history) == 2 * 512 // 16
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_a_slow_worker_is_not_mistaken_for_a_silent_one(monkeypatch) -> None:
    """Stage 1 computes (holding the GIL) 2 s per forward, hundreds of times the other stages and twice
    the time after which a worker showing no sign of life is declared silent (here 1 s): it still
    shows signs of life, so the job ends normally."""
    monkeypatch.setattr(pipetrain.api, "SILENT_AFTER_S", 1.0)
    net = deep(layers=4)
    net = nn.Sequential(net[0], BusyOn(1, 2.0), *net[1:])
    result = pipetrain.train(net, regression(16, 4, 3), loss_fn=torch.nn.functional.mse_loss, optimizer=SGD,
                             stages=[0, 1, 3], batch_size=4)
    assert len(result.history) == 4
