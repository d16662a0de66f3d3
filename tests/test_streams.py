"""Streams (``IterableDataset``): read in their own order, one pass an epoch, they train bitwise as the
map-style dataset of the same items with ``shuffle=False``, under every strategy and the schedules that
read data differently; ``max_steps`` bounds a run and a stream of unknown length."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import pipetrain
from pipetrain.errors import PipetrainError, PipetrainWarning
from pipetrain.planning import Plan, StagePlan
from pipetrain.streams import head, is_stream, passes

N, BATCH = 64, 8


def pairs(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.tanh(x @ torch.randn(4, 3, generator=g, dtype=torch.float64)))


class Stream(IterableDataset):
    """The items of a map-style dataset, yielded in order (as dictionaries where ``dicts``); no len()."""

    def __init__(self, data: TensorDataset, dicts: bool = False) -> None:
        self.data, self.dicts = data, dicts
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        for i in range(len(self.data)):
            x, y = self.data[i]
            yield {"x": x, "labels": y} if self.dicts else (x, y)


class Sized(Stream):
    def __len__(self) -> int:
        return len(self.data)


class Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def net() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def train(data, model: nn.Module | None = None, **kw) -> pipetrain.TrainResult:
    args = dict(loss_fn=nn.functional.mse_loss, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                batch_size=BATCH, epochs=2, shuffle=False, timeout=60)
    return pipetrain.train(model if model is not None else net(), data, **{**args, **kw})


def same(a: pipetrain.TrainResult, b: pipetrain.TrainResult) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]


JOBS = {
    "ddp": dict(strategy="ddp", workers=2),
    "pipe-sgd": dict(strategy="pipe-sgd", workers=2),
    "cgdp": dict(strategy="cgdp", workers=2),
    "pipedream": dict(stages=[0, 2, 4], schedule="pipedream"),
    "pipedream replicated": dict(stages=Plan([StagePlan(0, 1, 2), StagePlan(2, 4, 1)], noam=2, stage_time_s=1.0, speedup_vs_dp=1.0,
                                             speedup_vs_one=1.0), schedule="pipedream"),
    "1f1b-flush": dict(stages=[0, 2], schedule=pipetrain.OneFOneBFlush(microbatches=2)),
    "zero-bubble": dict(stages=[0, 2], schedule=pipetrain.ZeroBubble(microbatches=2)),
}


def layout(job: str) -> dict:
    return dict(JOBS[job])


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", list(JOBS))
def test_a_stream_trains_bitwise_as_the_same_items_in_order(job: str) -> None:
    mapped = train(pairs(), eval_dataset=pairs(16), **layout(job))
    streamed = train(Stream(pairs()), eval_dataset=Stream(pairs(16)), **layout(job))
    same(mapped, streamed)
    assert mapped.history[-1]["eval"] == streamed.history[-1]["eval"]
    assert len(streamed.history) == 2 * N // BATCH


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", ["ddp", "pipedream replicated"])
def test_a_stream_read_ahead_by_loaders_trains_bitwise_as_read_inline(job: str) -> None:
    inline = train(Stream(pairs(), dicts=True), Keyword(), target_key="labels", **layout(job))
    ahead = train(Stream(pairs(), dicts=True), Keyword(), target_key="labels", loader_workers=2, prefetch=1,
                  **layout(job))
    same(inline, ahead)


@pytest.mark.multiprocess
def test_max_steps_stops_the_run_where_a_shorter_dataset_would(tmp_path) -> None:
    """Bounded at 10 updates, 2 epochs of 8 minibatches stop 2 into the second; a stream of unknown length
    is read once, up to the bound, and the metrics log carries the run's length."""
    stages = dict(stages=[0, 2], schedule="1f1b-flush")
    bounded = train(pairs(), epochs=3, max_steps=10, log_dir=tmp_path, **stages)
    assert len(bounded.history) == 10 and bounded.epochs_trained == 2
    assert [h["epoch"] for h in bounded.history] == [0] * 8 + [1] * 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["total_steps"] for r in records if r["kind"] == "update"} == {10}
    first_ten = TensorDataset(*(torch.cat([t, t[:2 * BATCH]]) for t in pairs().tensors))
    same(bounded, train(first_ten, epochs=1, **stages))
    once = train(Stream(pairs()), epochs=1, max_steps=5, **stages)
    same(once, train(TensorDataset(*(t[:5 * BATCH] for t in pairs().tensors)), epochs=1, **stages))


@pytest.mark.multiprocess
def test_a_stream_shorter_than_max_steps_fails_naming_where_it_ended() -> None:
    with pytest.raises(PipetrainError, match=r"the stream ended after 64 items, but minibatch 8 needs item 64"):
        train(Stream(pairs()), epochs=1, max_steps=12, stages=[0, 2])


@pytest.mark.multiprocess
def test_a_stream_resumes_at_the_epoch_boundary(tmp_path) -> None:
    stream = Sized(pairs())
    train(stream, epochs=1, stages=[0, 2], checkpoint_dir=tmp_path)
    resumed = train(Sized(pairs()), epochs=3, stages=[0, 2], checkpoint_dir=tmp_path, resume=True)
    assert resumed.epochs_trained == 2
    whole = train(pairs(), epochs=3, stages=[0, 2])
    sa, sb = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_stream_of_unknown_length_is_counted_and_its_tail_left_out_said_once() -> None:
    """Counting reads it once in the caller; 60 items make 7 minibatches of 8 and 4 left over."""
    from pipetrain.config import Training

    with pytest.warns(PipetrainWarning, match=r"^the stream's last 4 items do not fill a minibatch of 8; every "
                                              r"epoch leaves them out$"):
        t = Training(model=net(), dataset=Stream(pairs(60)), loss_fn=nn.functional.mse_loss,
                     optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=BATCH, epochs=2)
    assert t.n_items == 60 and t.epoch_minibatches(1) == 7 and t.steps(1) == 14
    assert t.order(1, 1)[-1] == list(range(48, 56))


@pytest.mark.parametrize("kw,message", [
    (dict(max_steps=0), r"^max_steps=0: give the most updates to make, an integer >= 1"),
    (dict(max_steps=4, epochs=2), r"^epochs=2 with a stream of unknown length bounded by max_steps: the run reads "
                                  r"the stream once; give epochs=1"),
])
def test_bad_max_steps_is_refused_in_one_line(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train(Stream(pairs()), stages=[0, 2], **kw)


def test_a_stream_is_told_apart_and_its_head_read_without_reading_it_all() -> None:
    stream = Stream(pairs())
    assert is_stream(stream) and not is_stream(pairs()) and not is_stream([1, 2])
    assert len(head(stream, 3)) == 3 and head(pairs(), 3) is not None
    list(passes(stream, 4))
    assert stream.epochs[-1] == 4
