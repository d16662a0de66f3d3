"""Data-parallel gradient sync for the replicas of one pipeline stage, with wait-free backpropagation.

A replicated stage (PipeDream §3.3) runs minibatch t on replica t mod r. Each replica's k-th
backward is averaged with the other replicas' k-th backwards before the k-th optimizer step, so all
replicas apply the same update and stay identical. Each parameter's allreduce starts from a hook the
moment autograd has accumulated its gradient, while the backward pass goes on through earlier layers
(wait-free backpropagation, as in Poseidon and PipeDream §4); ``A`` finds them started and ``S`` waits
for them all.

Update rule of a replicated stage s with r replicas and warm-up w = ceil(workers in stages s.. / r)
(0-based minibatch ids): update k (k = 1, 2, ...) applies the mean gradient of minibatches
r(k-1) .. rk-1, and minibatch t's gradient is taken at the weights after max(0, floor(t/r) - w + 1)
updates. With r = 1 this is the straight-pipeline rule.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipetrain.strategies.base import GradSync, SyncContext, Weights


class ReplicaAllreduce(GradSync):
    """Averages gradients across one stage's replicas through the stage's own process group.

    Args:
        group: the process group of the stage's replicas (every rank creates every stage's group).
        replicas: the number of replicas (the group's size).
    """

    def __init__(self, group: dist.ProcessGroup, replicas: int) -> None:
        self.group, self.replicas = group, replicas
        self._pending: list[tuple[torch.Tensor, dist.Work]] = []
        self.bytes_sent = 0  # estimated: a ring allreduce sends 2(r-1)/r of the tensor per worker

    def watch(self, weights: Weights) -> None:
        """Start an allreduce for each of ``weights`` as soon as its gradient is accumulated."""
        for t in weights.values():
            # a mark on the tensor, not its id(): ids of dropped stashes are reused
            if t.requires_grad and getattr(t, "_pipetrain_sync", None) is not self:
                t._pipetrain_sync = self  # type: ignore[attr-defined]
                t.register_post_accumulate_grad_hook(self._start)

    def _start(self, t: torch.Tensor) -> None:
        assert t.grad is not None
        self.bytes_sent += 2 * (self.replicas - 1) * t.grad.numel() * t.grad.element_size() // self.replicas
        self._pending.append((t, dist.all_reduce(t.grad, group=self.group, async_op=True)))

    def wait(self, mb: int, weights: Weights) -> None:
        """Wait for every started allreduce and turn the sums into means."""
        for t, work in self._pending:
            work.wait()
            t.grad.div_(self.replicas)  # type: ignore[union-attr]
        self._pending.clear()


def replica_groups(ctx: SyncContext) -> GradSync | None:
    """A pipeline's synchronizer: the stage's replica allreduce, or None for a stage on one worker.

    Every rank makes every replicated stage's group, in stage order, as ``new_group`` requires.
    """
    firsts = [sum(ctx.replicas[:s]) for s in range(len(ctx.replicas))]
    groups = {s: dist.new_group(list(range(firsts[s], firsts[s] + r)))
              for s, r in enumerate(ctx.replicas) if r > 1}
    return ReplicaAllreduce(groups[ctx.stage], ctx.replicas[ctx.stage]) if ctx.stage in groups else None
