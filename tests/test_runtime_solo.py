"""One worker run alone (pipetrain.runtime.solo): the job's own worker, its schedule's actions, no peers."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from pipetrain.batches import collate_parts
from pipetrain.config import JobConfig, RunOptions, Training
from pipetrain.layout import Layout
from pipetrain.registry import (
    Auto, GPipe, PipeDream, Pipeline, PipelineSchedule, as_schedule, as_strategy, schedule_of,
)
from pipetrain.runtime.solo import run_stage_alone
from pipetrain.schedule import Action
from pt_models import Residual

BATCH, MINIBATCHES = 4, 6


def tiny() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def job(schedule: str | PipelineSchedule | None = "pipedream", boundaries: list[int] | None = None,
        replicas: list[int] | None = None, strategy: str = "pipeline", threads: int | None = None,
        model: nn.Module | None = None, data: TensorDataset | None = None) -> JobConfig:
    g = torch.Generator().manual_seed(1)
    n = BATCH * MINIBATCHES
    data = data or TensorDataset(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))
    training = Training(model=model or tiny(), dataset=data, loss_fn=nn.functional.cross_entropy,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=BATCH, shuffle=False)
    chosen = as_strategy(strategy)
    assert not isinstance(chosen, Auto)
    layout = Layout.data_parallel_on(replicas[0]) if chosen.data_parallel and replicas else \
        Layout.pipeline(boundaries or [0, 2], replicas)
    return JobConfig(training, RunOptions(threads=threads), chosen,
                     as_schedule(schedule) if schedule is not None else None, layout)


def check_order(cfg: JobConfig, records: list[tuple[str, float, float]], rank: int, minibatches: int) -> None:
    """The records are the worker's schedule, action for action, one after another in time."""
    expected = [str(a) for a in cfg.schedule_for(0, minibatches).actions[rank]]
    assert [text for text, _, _ in records] == expected
    assert all(s <= e for _, s, e in records)
    assert all(e <= s2 for (_, _, e), (_, s2, _) in zip(records, records[1:]))


@pytest.mark.parametrize("schedule,m", [("pipedream", 1), ("gpipe", 2), ("1f1b-flush", 2), ("model-parallel", 1),
                                        ("naive", 1)])
@pytest.mark.parametrize("stage", [0, 1])
def test_each_stage_runs_its_schedule_alone(schedule, m, stage):
    cfg = job(schedule_of(schedule, m))
    before = {k: v.clone() for k, v in cfg.training.model.state_dict().items()}
    records = run_stage_alone(cfg, stage, 4)
    check_order(cfg, records, stage, 4)
    kinds = {Action.parse(text).kind for text, _, _ in records}
    assert kinds == ({"F", "SF", "RB", "B", "U"} if stage == 0 else {"RF", "F", "B", "SB", "U"})
    assert not dist.is_initialized()  # no process group, no peers
    assert all(torch.equal(v, before[k]) for k, v in cfg.training.model.state_dict().items())  # the caller's model is kept


def test_whole_epoch_by_default_and_vertical_sync_gets_the_input_stages_versions():
    cfg = job(PipeDream(vertical_sync=True))
    check_order(cfg, run_stage_alone(cfg, 1), 1, MINIBATCHES)


def test_two_tensors_cross_the_cut():
    """An fx model cut inside a residual block: stage 1 receives a tuple and stage 0 its two gradients."""
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(BATCH * 4, 4, generator=g), torch.randn(BATCH * 4, 3, generator=g))
    training = Training(model=Residual(), dataset=data, loss_fn=nn.functional.mse_loss,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=BATCH, shuffle=False)
    cfg = JobConfig(training, RunOptions(), Pipeline(), GPipe(microbatches=2), Layout.pipeline([0, 2, 4]))
    for stage in range(3):
        check_order(cfg, run_stage_alone(cfg, stage), stage, 4)


def test_replicas_sync_at_once():
    cfg = job(replicas=[2, 1])
    records = run_stage_alone(cfg, 0, 4, replica=1)
    check_order(cfg, records, 1, 4)
    assert {"A", "S"} <= {Action.parse(text).kind for text, _, _ in records}
    ddp = job(None, strategy="ddp", replicas=[2])
    check_order(ddp, run_stage_alone(ddp, 0, 2, replica=1), 1, 2)


def test_threads_restored_and_bad_requests_refused():
    threads = torch.get_num_threads()
    cfg = job(threads=1)
    run_stage_alone(cfg, 0, 2)
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="stage 2 replica 0 is not in this job"):
        run_stage_alone(cfg, 2)
    with pytest.raises(ValueError, match="minibatches=7"):
        run_stage_alone(cfg, 0, 7)


class Counted(torch.utils.data.Dataset):
    """(inputs, class) items that count every fetch; with ``batched``, also a ``__getitems__`` that
    counts its calls (the batched fetch ``DataLoader`` uses)."""

    def __init__(self, n: int, batched: bool = False) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g)
        self.fetched: list[int] = []
        self.batched_calls = 0
        if batched:
            self.__getitems__ = self._getitems

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.fetched.append(i)
        return self.x[i], self.y[i]

    def _getitems(self, items: list[int]) -> list:
        self.batched_calls += 1
        return [self[i] for i in items]


@pytest.mark.parametrize("batched", [False, True])
def test_a_worker_that_builds_inputs_and_targets_fetches_each_item_once(batched):
    """One stage (every layer on one worker, as data parallelism too) builds a minibatch's inputs and
    targets from one fetch of each item; a pipeline's first and last stages fetch for their own part."""
    data = Counted(BATCH * MINIBATCHES, batched)
    cfg, pipeline = job(boundaries=[0], data=data), job(boundaries=[0, 2], data=data)
    for job_, stage in ((cfg, 0), (pipeline, 0), (pipeline, 1)):
        data.fetched.clear()
        data.batched_calls = 0
        run_stage_alone(job_, stage, 4)
        # checking the job and sampling its first minibatch fetch items of that minibatch first
        assert data.fetched[-4 * BATCH:] == list(range(4 * BATCH))
        assert data.batched_calls >= (4 if batched else 0)


def test_a_tensor_datasets_minibatch_is_what_default_collate_builds():
    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(10, 3, 2, generator=g), torch.randint(5, (10,), generator=g))
    items = [7, 2, 2, 9]
    inputs, targets = collate_parts(data, items, (0, 1))
    expected = default_collate([data[i] for i in items])
    for got, want in zip((inputs, targets), expected):
        assert got.dtype == want.dtype and torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(collate_parts(data, range(3), (1,))[0], data.tensors[1][:3])
