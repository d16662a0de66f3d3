"""``strategy="ddp"``: PyTorch's ``DistributedDataParallel``, the synchronous baseline users know.

DDP allreduces gradient buckets from autograd hooks during the backward and has averaged them by the
time ``backward()`` returns, so ``A`` and ``S`` have nothing left to do. It uses the default process
group (gloo on CPU, NCCL on GPU).

Buffers (BatchNorm's running statistics) are not broadcast from rank 0 at every forward, as DDP does
by default: each worker keeps its own shard's, and every data-parallel strategy averages them over the
workers at each epoch's end (:func:`pipetrain.runtime.job.agree_buffers`), so switching strategies
does not change what a model's statistics mean.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipetrain.strategies.base import GradSync, SyncContext, Weights


BUCKET_BYTES = 25 << 20
"""DDP's ``bucket_cap_mb`` default: gradients are allreduced in buckets of about this many bytes."""
FIRST_BUCKET_BYTES = 1 << 20
"""DDP's first bucket (the last layers' gradients) is this small, so its allreduce starts early."""
_NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False})
"""No buffer broadcast at each forward, in the words of the installed torch (newer ones deprecate
``broadcast_buffers``; the new flag still copies rank 0's buffers once at the start, when every
worker's are the same anyway)."""


class DDPSync(GradSync):
    """Wraps the model in ``DistributedDataParallel``; counts the bytes a ring allreduce moves.

    Args:
        workers: M, the data-parallel workers.
        ctx: this worker's context (its device picks DDP's ``device_ids``).
    """

    def __init__(self, workers: int, ctx: SyncContext) -> None:
        self.workers, self.ctx = workers, ctx
        self.bytes_sent = 0

    def wrap(self, module: nn.Module) -> nn.Module:
        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, **_NO_BUFFER_SYNC)

    def start(self, mb: int, weights: Weights) -> None:
        """Estimate what DDP sent for this minibatch: a ring's 2(M-1)/M of the gradient bytes."""
        grad = sum(p.numel() * p.element_size() for p in weights.values() if p.requires_grad)
        self.bytes_sent += 2 * (self.workers - 1) * grad // self.workers


def ddp(ctx: SyncContext) -> GradSync:
    """The ``ddp`` strategy's synchronizer."""
    return DDPSync(ctx.layout.world, ctx)
