"""Minibatches built ahead by loader processes: the same results as built inline (each item fetched with
its own seed), errors that name the item, and a killed loader survived like a killed worker."""
from __future__ import annotations

import functools
import multiprocessing
import os
import random
import re
import signal

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain import costs
from pipetrain.errors import PipetrainError
from pipetrain.profiling import LayerProfile, Profile
from pipetrain.runtime.loader import Inline, LoadError, Recipe, Task, build
from pipetrain.stagecost import stage_costs

N, BATCH = 48, 4


class Noisy(torch.utils.data.Dataset):
    """Regression pairs whose inputs get a random jitter from torch's global generator, and a Python
    ``random`` one, each fetch; item ``fail`` raises KeyError; a loader process fetching item ``kill``
    a second time SIGKILLs itself, once per ``marker`` file."""

    def __init__(self, n: int = N, fail: int | None = None, kill: int | None = None, marker: str = "") -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, 3, generator=g, dtype=torch.float64)
        self.fail, self.kill, self.marker = fail, kill, marker

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.fail:
            raise KeyError(f"no item {i}")
        if i == self.kill and multiprocessing.current_process().name.startswith("pipetrain-loader"):
            seen, killed = self.marker + ".seen", self.marker + ".killed"
            if os.path.exists(seen) and not os.path.exists(killed):
                open(killed, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            open(seen, "w").close()
        return self.x[i] + 0.1 * torch.randn(4, dtype=torch.float64) + random.random(), self.y[i]


def expected_item(data: Noisy, seed: int, epoch: int, i: int) -> torch.Tensor:
    """Item ``i``'s input as the rule says: torch and ``random`` seeded from (seed, epoch, training, i)."""
    s = ((seed * 1_000_003 + epoch) * 2 + 0) * 2 ** 32 + i
    jitter = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
    return data.x[i] + 0.1 * jitter + random.Random(s).random()


def test_each_item_is_fetched_with_its_own_seed_and_the_callers_random_state_is_kept() -> None:
    data = Noisy()
    torch.manual_seed(5)
    random.seed(5)
    untouched = torch.rand(3), random.random()
    torch.manual_seed(5)
    random.seed(5)
    x, y = build(Recipe(data, seed=7), Task(2, (9, 3, 30), (0, 1), epoch=4))
    after = torch.rand(3), random.random()
    assert torch.equal(after[0], untouched[0]) and after[1] == untouched[1]
    assert torch.equal(x, torch.stack([expected_item(data, 7, 4, i) for i in (9, 3, 30)]))
    assert torch.equal(y, data.y[[9, 3, 30]])
    # the same item in another minibatch, order or part set draws the same jitter
    (alone,) = build(Recipe(data, seed=7), Task(0, (3,), (0,), epoch=4))
    assert torch.equal(alone[0], x[1])


def test_an_inline_failure_names_the_item_and_minibatch() -> None:
    source = Inline(Recipe(Noisy(fail=17)))
    source.begin([Task(4, (16, 17, 18, 19), (0, 1), epoch=0)])
    with pytest.raises(LoadError, match=r"^the dataset failed on item 17 of minibatch 4: KeyError: 'no item 17'$"):
        source.get(4)


def test_loading_ahead_hides_behind_compute() -> None:
    assert costs.loading_wait_s(0.032, 0, 0.020) == 0.032            # inline: all of it
    assert costs.loading_wait_s(0.032, 2, 0.020) == 0.0              # 16 ms a minibatch, under 20 ms of compute
    assert costs.loading_wait_s(0.032, 1, 0.020) == pytest.approx(0.012)
    layers = [LayerProfile("a", 0.004, 0.006, 10, 10, 0.001), LayerProfile("b", 0.002, 0.003, 10, 10)]
    profile = Profile(layers, 8, "cpu", inputs_s=0.03, targets_s=0.01, both_s=0.035)
    assert profile.building_s(0, 2) == 0.035 and profile.building_s(1, 2) == 0.01
    ahead = Profile(layers, 8, "cpu", inputs_s=0.03, targets_s=0.01, both_s=0.035, loaders=2)
    assert ahead.building_s(0, 2) == pytest.approx(0.035 / 2 - 0.016)   # the whole model's 16 ms of compute
    assert ahead.building_s(0, 1) == pytest.approx(0.015 - 0.011)
    assert ahead.building_s(1, 2) == 0.0
    assert Profile.from_dict(ahead.to_dict()).loaders == 2
    # what a stage is charged scales with the batch, as its compute does
    assert stage_costs(ahead, [0, 1], batch_size=16)[0].batching_s == pytest.approx(2 * (0.015 - 0.011))


@pytest.mark.parametrize("bad", [dict(loader_workers=-1), dict(loader_workers=1.5), dict(prefetch=0)])
def test_bad_loader_options_are_refused_before_any_worker_starts(bad: dict) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=rf"^{name}=.*: give an integer"):
        train(Noisy(), "ddp", **bad)


def net() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


LAYOUTS = {"ddp": dict(strategy="ddp", workers=2), "pipeline": dict(stages=[0, 3]),
           "gpipe": dict(stages=[0, 2, 4], schedule=pipetrain.GPipe(microbatches=2))}


def train(data: Noisy, layout: str, **kw) -> pipetrain.TrainResult:
    return pipetrain.train(net(), data, loss_fn=nn.functional.mse_loss,
                           optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=BATCH, epochs=2,
                           seed=3, timeout=60, **{**LAYOUTS[layout], **kw})


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loaders_train_bitwise_as_inline(layout: str) -> None:
    inline = train(Noisy(), layout, eval_dataset=Noisy(16))
    ahead = train(Noisy(), layout, eval_dataset=Noisy(16), loader_workers=2, prefetch=1)
    a, b = inline.model.state_dict(), ahead.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in inline.history] == [h["loss"] for h in ahead.history]
    assert inline.history[-1]["eval"] == ahead.history[-1]["eval"]


@pytest.mark.multiprocess
def test_a_loader_failure_names_the_worker_loader_item_and_minibatch() -> None:
    with pytest.raises(PipetrainError) as e:
        train(Noisy(fail=17), "pipeline", loader_workers=2, shuffle=False)
    assert re.match(r"StageError: stage 0 \(rank 0\): loader [01] failed on item 17 of minibatch 4: KeyError: 'no item 17'",
                    str(e.value)), str(e.value)
    assert e.value.kind == "error"


@pytest.mark.multiprocess
def test_a_killed_loader_is_survived_like_a_killed_worker(tmp_path) -> None:
    data = Noisy(kill=13, marker=str(tmp_path / "kill"))  # killed in epoch 1, when the loader fetches it again
    result = train(data, "ddp", loader_workers=2, shuffle=False, checkpoint_dir=tmp_path / "ckpt", max_restarts=1)
    assert len(result.restarts) == 1, "the loader was not killed"
    assert re.search(r"^StageError: worker [01]: its loader process died: loader [01] \(killed by SIGKILL\) while building "
                     r"minibatch \d+", result.restarts[0]["error"]), result.restarts[0]["error"]
    assert result.restarts[0]["resumed_after_epoch"] == 0
    uninterrupted = train(Noisy(), "ddp", shuffle=False)
    a, b = uninterrupted.model.state_dict(), result.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
