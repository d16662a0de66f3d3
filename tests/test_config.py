"""The job's configuration: the layout's rank arithmetic, options that belong to their strategy or
schedule, and the checks that span the parts, all before any worker starts."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.config import JobConfig, RunOptions, Training
from pipetrain.layout import Layout
from pipetrain.registry import as_schedule, as_strategy, from_options, schedule_of


def test_a_replicated_layout_numbers_its_ranks_stage_by_stage() -> None:
    """2-1-1: ranks 0 and 1 are stage 0's replicas (minibatches round robin), 2 and 3 one stage each."""
    layout = Layout.pipeline([0, 3, 5], [2, 1, 1])
    assert layout.world == 4 and layout.config == "2-1-1" and layout.rounds == 2
    assert [layout.stage_of(r) for r in range(4)] == [0, 0, 1, 2]
    assert [layout.replica_of(r) for r in range(4)] == [0, 1, 0, 0]
    assert [layout.worker_for(0, mb) for mb in range(4)] == [0, 1, 0, 1]
    assert [layout.name(r) for r in (1, 2)] == ["stage 0 replica 1 (rank 1)", "stage 1 (rank 2)"]
    assert [r for r in range(4) if layout.reporter(r)] == [3]
    assert layout.edges() == [(0, 2), (1, 2), (2, 0), (2, 1), (2, 3), (3, 2)]
    assert layout.layer_range(1, 9) == (3, 4) and layout.layer_range(2, 9) == (5, 8)


def test_a_data_parallel_layout_is_one_sharded_stage() -> None:
    layout = Layout.data_parallel_on(3)
    assert (layout.world, layout.num_stages, layout.rounds, layout.data_parallel) == (3, 1, 1, True)
    assert [layout.name(r) for r in range(3)] == ["worker 0", "worker 1", "worker 2"]
    assert [r for r in range(3) if layout.reporter(r)] == [0] and layout.edges() == []


@pytest.mark.parametrize("make,message", [
    (lambda: Layout((2, 0)), r"replicas \[2, 0\]: give a worker count of at least 1"),
    (lambda: Layout.pipeline([0, 3], [1]), r"replicas \[1\] give a worker count for 1 stages, but stages=\[0, 3\]"),
    (lambda: Layout.data_parallel_on(0), "workers=0: give the number of workers, at least 1"),
    (lambda: Layout((2, 2), sharded=True), "a data-parallel layout has one stage, not 2"),
])
def test_a_layout_that_does_not_add_up_is_refused(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_names_mean_the_defaults_and_objects_carry_their_options() -> None:
    assert as_strategy("pipe-sgd") == pipetrain.PipeSGD(staleness=2, compression=None, warmup_epochs=0)
    assert as_schedule("gpipe") == pipetrain.GPipe(microbatches=1)
    assert schedule_of("1f1b-flush", 4) == pipetrain.OneFOneBFlush(microbatches=4)
    assert from_options("pipe-sgd", staleness=3) == (pipetrain.PipeSGD(staleness=3), None)
    assert from_options("pipeline", "gpipe", microbatches=2) == (pipetrain.Pipeline(), pipetrain.GPipe(2))
    assert pipetrain.PipeSGD(warmup_epochs=1).staleness_at(0) == 1 and pipetrain.PipeSGD().staleness_at(1) == 2


@pytest.mark.parametrize("call,message", [
    (lambda: from_options("pipeline", microbatches=2), "microbatches applies to schedule 'gpipe' or '1f1b-flush'( or '[^']+')*, "
                                                       "not 'pipedream'"),
    (lambda: from_options("ddp", "gpipe"), "schedule applies to strategy 'pipeline', not 'ddp'"),
    (lambda: from_options("cgdp", vertical_sync=True), "vertical_sync applies to strategy 'pipeline', not 'cgdp'"),
    (lambda: from_options("auto", chunk=2), "chunk applies to strategy 'cgdp', not 'auto'"),
    (lambda: pipetrain.PipeSGD(staleness=True), "staleness=True must be an integer >= 1"),
    (lambda: pipetrain.PipeDream(vertical_sync="yes"), "vertical_sync='yes' must be True or False"),
    (lambda: as_strategy("horovod"), "unknown strategy 'horovod'"),
    (lambda: as_schedule("zigzag"), "unknown schedule 'zigzag'"),
])
def test_an_option_given_to_what_does_not_take_it_is_one_line(call, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


def training(items: int = 32, batch_size: int = 8, model: nn.Module | None = None) -> Training:
    data = TensorDataset(torch.randn(items, 4), torch.randn(items, 2))
    net = model or nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return Training(model=net, dataset=data, loss_fn=nn.functional.mse_loss,
                    optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=batch_size)


@pytest.mark.parametrize("make,message", [
    (lambda: JobConfig(training(), RunOptions(), pipetrain.DDP(), None, Layout.data_parallel_on(3)),
     "batch_size 8 does not split into 3 equal shards"),
    (lambda: JobConfig(training(), RunOptions(), pipetrain.DDP(), pipetrain.GPipe(), Layout.data_parallel_on(2)),
     "it takes workers=N, not stages or a schedule"),
    (lambda: JobConfig(training(), RunOptions(), pipetrain.Pipeline(), pipetrain.GPipe(microbatches=3),
                       Layout.pipeline([0, 2])), "batch_size 8 is not divisible by microbatches 3"),
    (lambda: JobConfig(training(), RunOptions(), pipetrain.Pipeline(), pipetrain.GPipe(), Layout.pipeline([0, 2],
                                                                                                          [2, 1])),
     "schedule 'gpipe' runs straight pipelines only"),
    (lambda: JobConfig(training(), RunOptions(), pipetrain.Pipeline(), pipetrain.PipeDream(vertical_sync=True),
                       Layout.pipeline([0, 2], [2, 1])), "vertical_sync needs one worker per stage"),
    (lambda: JobConfig(training(items=16), RunOptions(), pipetrain.Pipeline(), pipetrain.PipeDream(),
                       Layout.pipeline([0, 2], [1, 3])), r"fewer than one round of minibatches \(24\)"),
    (lambda: JobConfig(training(), RunOptions(), pipetrain.Pipeline(), pipetrain.PipeDream(),
                       Layout.pipeline([0, 9])), "below the layer count 3"),
    (lambda: RunOptions(max_restarts=1), "max_restarts needs checkpoint_dir"),
    (lambda: RunOptions(keep_checkpoints=1), "keep_checkpoints=1: keep at least 2"),
    (lambda: training(items=4), "the dataset has 4 items, fewer than one minibatch of 8"),
])
def test_the_rules_that_span_the_parts_are_checked_when_the_job_is_made(make, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        make()
    assert "\n" not in str(e.value)


def test_a_valid_job_says_what_each_rank_runs() -> None:
    cfg = JobConfig(training(items=64), RunOptions(threads=1), pipetrain.Pipeline(), pipetrain.PipeDream(),
                    Layout.pipeline([0, 2], [2, 1]))
    assert cfg.world == 3 and cfg.threads == 1 and cfg.microbatches == 1
    assert [cfg.policy_name(s) for s in range(2)] == ["stash", "live"]  # the output stage holds one minibatch
    schedule = cfg.schedule_for(0, 4)
    assert schedule.replicas == (2, 1) and schedule.stashes
    assert cfg.identity()["layout"] == {"boundaries": [0, 2], "replicas": [2, 1]}
    stale = JobConfig(training(), RunOptions(), pipetrain.PipeSGD(warmup_epochs=1), None, Layout.data_parallel_on(2))
    in_epoch = [" ".join(map(str, stale.schedule_for(epoch, 2).actions[0])) for epoch in (0, 1)]
    assert in_epoch == ["F0 B0 A0 S0 U0 F1 B1 A1 S1 U1", "F0 B0 A0 F1 B1 A1 S0 U0 S1 U1"]  # warm-up: K = 1


def test_the_backend_is_checked_before_any_worker_starts(monkeypatch) -> None:
    """``auto`` is gloo without a GPU per worker; ``nccl`` without one is refused in one line, before the
    launcher runs (the fast tier fails any test that starts a process)."""
    from pipetrain.runtime.dist import check_backend, resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_backend("auto", 2) == "gloo" and resolve_backend("nccl", 2) == "nccl"
    with pytest.raises(ValueError, match=r"backend='nccl' needs a GPU per worker, but 2 workers on this machine "
                                         r"would share 0 GPUs \(NCCL refuses two ranks on one GPU\)"):
        check_backend("nccl", 2)
    with pytest.raises(ValueError, match="backend='mpi': use one of 'auto', 'gloo', 'nccl'"):
        RunOptions(backend="mpi")
    t = training()
    with pytest.raises(ValueError, match="backend='nccl' needs a GPU per worker"):
        pipetrain.train(t.model, t.dataset, loss_fn=t.loss_fn, optimizer=t.optimizer, stages=[0, 2], batch_size=8,
                        backend="nccl")


def test_gpu_tensors_cross_gloo_through_host_memory_and_nccl_as_they_are(monkeypatch) -> None:
    from pipetrain.runtime import dist as pt_dist

    cuda = torch.device("cuda", 0)
    for backend, wire in (("gloo", torch.device("cpu")), ("nccl", cuda)):
        monkeypatch.setattr(pt_dist.dist, "get_backend", lambda group=None, b=backend: b)
        assert pt_dist.wire_device(cuda) == wire and pt_dist.wire_device(torch.device("cpu")) == torch.device("cpu")


def test_an_optimizer_built_already_is_named_by_its_class_in_one_line() -> None:
    """An optimizer instance's repr spans a dozen lines; the error names its class instead."""
    model = nn.Linear(4, 3)
    data = TensorDataset(torch.zeros(8, 4), torch.zeros(8, 3))
    with pytest.raises(ValueError) as info:
        Training(model=model, dataset=data, loss_fn=torch.nn.functional.mse_loss,
                 optimizer=torch.optim.AdamW(model.parameters()))
    assert str(info.value) == ("optimizer=<a AdamW> is not callable; pass a function such as "
                               "functools.partial(torch.optim.SGD, lr=0.1)")
