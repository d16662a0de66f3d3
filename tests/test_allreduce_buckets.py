"""A replicated stage's gradients go out in buckets and come back to the right tensors (one process:
the allreduce of one rank is the identity, so what comes back is each gradient / replicas)."""
import pytest
import torch
import torch.distributed as dist

from pipetrain.strategies import allreduce
from pipetrain.strategies.allreduce import ReplicaAllreduce, buckets


@pytest.fixture
def world_of_one():
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if made:
        dist.destroy_process_group()


def test_buckets_split_by_size_and_dtype_and_return_each_mean(world_of_one, monkeypatch) -> None:
    monkeypatch.setattr(allreduce, "BUCKET_BYTES", 100)
    torch.manual_seed(0)
    weights = {"a": torch.randn(10, dtype=torch.float64, requires_grad=True),   # 80 B
               "b": torch.randn(3, 4, dtype=torch.float64, requires_grad=True),  # 96 B: fills the first bucket
               "c": torch.randn(5, requires_grad=True),                          # float32: a bucket of its own
               "d": torch.randn(2, 2, dtype=torch.float64, requires_grad=True)}
    sync = ReplicaAllreduce(world_of_one, replicas=2)
    sync.watch(weights)
    loss = sum((w.double() ** 2).sum() * (i + 1) for i, w in enumerate(weights.values()))
    loss.backward()
    want = {k: 2 * (i + 1) * w.detach() / 2 for i, (k, w) in enumerate(weights.items())}
    sync.start(0, weights)
    # in either order autograd may take: a and b share a bucket that their 176 B close, c (float32) is
    # alone between dtype changes, d is alone: three allreduces
    assert len(sync._pending) == 3
    sync.wait(0, weights)
    for k, w in weights.items():
        assert w.grad.dtype == w.dtype
        assert torch.equal(w.grad, want[k].to(w.dtype)), k
    assert sync._pending == [] and sync._bucket == []


def test_bucket_count() -> None:
    assert [buckets(n) for n in (0, 1, allreduce.BUCKET_BYTES, allreduce.BUCKET_BYTES + 1)] == [1, 1, 1, 2]
