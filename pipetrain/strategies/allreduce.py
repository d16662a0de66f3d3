"""Data-parallel gradient sync for the replicas of one pipeline stage, with wait-free backpropagation.

A replicated stage (PipeDream §3.3) runs minibatch t on replica t mod r. Each replica's k-th
backward is averaged with the other replicas' k-th backwards before the k-th optimizer step, so all
replicas apply the same update and stay identical. Gradients are allreduced in buckets of about
BUCKET_BYTES: hooks add each parameter's gradient to the open bucket the moment autograd has
accumulated it, and a full bucket's allreduce starts while the backward pass goes on through earlier
layers (wait-free backpropagation, as in Poseidon and PipeDream §4); ``A`` starts the last, partial
bucket and ``S`` waits for them all.

[Note: buckets] An allreduce per parameter tensor would pay the ring's 2(r-1) message latencies per
tensor, so a model of many small tensors (a Transformer's norms and biases) would wait in ``S`` many
times what one allreduce of its whole gradient takes. Buckets, as DDP's, pay them once per bucket; the
simulator prices a stage's sync as that many ring allreduces (:func:`buckets`).

Update rule of a replicated stage s with r replicas and warm-up w = ceil(workers in stages s.. / r)
(0-based minibatch ids): update k (k = 1, 2, ...) applies the mean gradient of minibatches
r(k-1) .. rk-1, and minibatch t's gradient is taken at the weights after max(0, floor(t/r) - w + 1)
updates. With r = 1 this is the straight-pipeline rule.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pipetrain.strategies.base import GradSync, SyncContext, Weights

BUCKET_BYTES = 1 << 20
"""Gradient bytes a replicated stage allreduces together (see [Note: buckets])."""


def buckets(nbytes: float) -> int:
    """Allreduces a replicated stage makes for ``nbytes`` of gradient per update."""
    return max(1, math.ceil(nbytes / BUCKET_BYTES))


def last_bucket_bytes(nbytes: float) -> float:
    """Bytes of the last of the :func:`buckets` of ``nbytes``: the one ``A`` starts after the backward."""
    return nbytes - (buckets(nbytes) - 1) * BUCKET_BYTES


class ReplicaAllreduce(GradSync):
    """Averages gradients across one stage's replicas through the stage's own process group.

    Args:
        group: the process group of the stage's replicas (every rank creates every stage's group).
        replicas: the number of replicas (the group's size).
    """

    def __init__(self, group: dist.ProcessGroup, replicas: int) -> None:
        self.group, self.replicas = group, replicas
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []  # (tensors, flat sum, work)
        self._bucket: list[torch.Tensor] = []
        self._bucket_bytes = 0
        self._final = True  # the running backward completes a minibatch's gradient
        self.bytes_sent = 0  # estimated: a ring allreduce sends 2(r-1)/r of the tensor per worker

    def watch(self, weights: Weights, final: bool = True) -> None:
        """Start an allreduce for each of ``weights`` as soon as its gradient is accumulated, in the
        ``final`` backward of a minibatch (when its gradient is whole)."""
        self._final = final
        for t in weights.values():
            # a mark on the tensor, not its id(): ids of dropped stashes are reused
            if t.requires_grad and getattr(t, "_pipetrain_sync", None) is not self:
                t._pipetrain_sync = self  # type: ignore[attr-defined]
                t.register_post_accumulate_grad_hook(self._start)

    def _start(self, t: torch.Tensor) -> None:
        assert t.grad is not None
        if not self._final:
            return
        if self._bucket and self._bucket[0].grad.dtype != t.grad.dtype:  # type: ignore[union-attr]
            self._flush()  # a bucket holds one dtype
        self._bucket.append(t)
        self._bucket_bytes += t.grad.numel() * t.grad.element_size()
        if self._bucket_bytes >= BUCKET_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Start the open bucket's allreduce, on a flat copy of its gradients."""
        if not self._bucket:
            return
        flat = torch.cat([t.grad.reshape(-1) for t in self._bucket])  # type: ignore[union-attr]
        self.bytes_sent += 2 * (self.replicas - 1) * flat.numel() * flat.element_size() // self.replicas
        self._pending.append((self._bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        self._bucket, self._bucket_bytes = [], 0

    def start(self, mb: int, weights: Weights) -> None:
        """The gradient is complete: start the last, partial bucket."""
        self._flush()

    def wait(self, mb: int, weights: Weights) -> None:
        """Wait for every started allreduce and put the means back on the gradients."""
        self._flush()
        for tensors, flat, work in self._pending:
            work.wait()
            flat.div_(self.replicas)
            offset = 0
            for t in tensors:
                grad = t.grad
                assert grad is not None
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._pending.clear()


def replica_groups(ctx: SyncContext) -> GradSync | None:
    """A pipeline's synchronizer: the stage's replica allreduce, or None for a stage on one worker.

    Every rank makes every replicated stage's group, in stage order, as ``new_group`` requires.
    """
    layout = ctx.layout
    groups = {s: dist.new_group(list(range(layout.first_rank(s), layout.first_rank(s) + r)))
              for s, r in enumerate(layout.replicas) if r > 1}
    return ReplicaAllreduce(groups[ctx.stage], layout.replicas[ctx.stage]) if ctx.stage in groups else None
