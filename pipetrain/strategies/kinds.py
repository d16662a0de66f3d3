"""The strategies by name, each a small class that owns its options and its hooks.

A strategy says how the workers share the training. :class:`Pipeline` cuts the model into stages
(PipeDream) and runs a :mod:`pipeline schedule <pipetrain.schedule.kinds>`; :class:`DDP`,
:class:`PipeSGD` and :class:`CGDP` give every worker the whole model and a shard of every minibatch,
and differ in how gradients are agreed on. Each class carries what depends on it: its options
(checked when made), the action lists it runs, the synchronizer a worker builds, and its prediction
(:meth:`Strategy.predict`, the model of its own paper run through the simulator).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pipetrain.costs import allreduce_copy_bytes
from pipetrain.planning.result import Plan
from pipetrain.predict.cgdp import best_chunk, host_costs, predict_on_host
from pipetrain.predict.dataparallel import predict_data_parallel
from pipetrain.predict.pipeline import best_plan, propose
from pipetrain.profiling import Profile
from pipetrain.schedule import generators as gen
from pipetrain.schedule.actions import Schedule
from pipetrain.schedule.kinds import PipeDream, check_count
from pipetrain.simulate import Link
from pipetrain.strategies.allreduce import replica_groups
from pipetrain.strategies.alone import OneWorker
from pipetrain.strategies.base import GradSync, SyncContext
from pipetrain.strategies.cgdp import HOST_MEMORY, cgdp, host_bytes
from pipetrain.strategies.compression import get_codec
from pipetrain.strategies.ddp import ddp
from pipetrain.strategies.pipesgd import pipe_sgd


@dataclass(frozen=True)
class Priced:
    """What a strategy's prediction found.

    Attributes:
        samples_per_s: the predicted rate (0 when ``skip`` says why there is none).
        strategy: the strategy with what the prediction settled (CGDP's chunk size).
        plan: a pipeline's plan.
        skip: why this strategy should not compete, or empty.
        detail: the whole prediction (:class:`~pipetrain.predict.DataParallelPrediction`,
            :class:`~pipetrain.predict.CGDPPrediction`), where there is one.
    """

    samples_per_s: float
    strategy: Strategy
    plan: Plan | None = None
    skip: str = ""
    detail: Any = None

    def options(self) -> dict[str, Any]:
        """The strategy and its options by name, as the CLI's flags give them, with a pipeline's plan
        (``stages``): plain data a choice records and :func:`pipetrain.registry.from_options` reads back."""
        return {**self.strategy.options(), **({"stages": self.plan} if self.plan is not None else {})}


@dataclass(frozen=True)
class Strategy:
    """A way to share training among workers.

    Class attributes (facts, not options):
        name: what ``strategy=`` says.
        data_parallel: every worker holds the whole model and takes a shard of every minibatch.
        summary: one line for help texts.
    """

    name: ClassVar[str]
    data_parallel: ClassVar[bool] = True
    summary: ClassVar[str]

    def synchronizer(self, ctx: SyncContext) -> GradSync | None:
        """This worker's gradient synchronizer (collective: every rank calls it), or None. One
        data-parallel worker has nothing to agree on (:mod:`pipetrain.strategies.alone`)."""
        return OneWorker() if ctx.layout.world == 1 else self.shared_sync(ctx)

    def shared_sync(self, ctx: SyncContext) -> GradSync:
        """The synchronizer of a data-parallel worker among several."""
        raise NotImplementedError

    def staleness_at(self, epoch: int) -> int:
        """K in ``epoch``: the minibatches a gradient is applied after (1: synchronous SGD)."""
        return 1

    def build(self, workers: int, minibatches: int, epoch: int = 0) -> Schedule:
        """A data-parallel strategy's action lists for one epoch: every worker runs every minibatch's
        shard, then the sync pass with this epoch's staleness (Pipe-SGD, Alg. 1; K = 1: synchronous)."""
        check_count(workers, "workers")
        check_count(minibatches, "minibatches", 0)
        return gen.data_parallel(workers, minibatches, self.staleness_at(epoch), self.name)

    def check_model(self, model: nn.Module) -> None:
        """One-line ValueError when this strategy cannot train ``model``."""

    def cannot_run(self, workers: int, batch_size: int, one_machine: bool) -> str:
        """Why this strategy cannot run ``workers`` workers on minibatches of ``batch_size`` (empty: it can)."""
        return f"batch {batch_size} does not split into {workers} equal shards" if batch_size % workers else ""

    def predict(self, profile: Profile, workers: int, link: Link, batch_size: int | None = None, *,
                minibatches: int | None = None, update_s: float | None = None,
                host: dict[str, float] | None = None) -> Priced:
        """Samples/s on ``workers`` workers linked by ``link``, from ``profile`` (and its measured
        set-up), by this strategy's own model.

        Args:
            batch_size: samples per minibatch of the whole job (default: the profile's).
            minibatches: how many the simulator runs (default: the prediction's own).
            update_s: seconds per optimizer step (default: the profile's).
            host: CGDP's host costs (``copy_s_per_byte``, ``sum_s_per_byte``, and optionally
                ``signal_s`` and ``cores_per_worker``), measured here when not given.
        """
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The name and options, as the CLI's flags give them."""
        return {"strategy": self.name}

    def check_host(self, model: nn.Module, local_workers: int) -> None:
        """One-line ValueError when this machine cannot hold what the strategy keeps beside the workers."""

    def sync_bytes(self, gradient_bytes: int, workers: int, device: str) -> int:
        """Bytes of the gradient copies one worker's synchronizer holds while ``workers`` agree on
        ``gradient_bytes`` of gradient, in the memory of ``device`` (``"cpu"`` or ``"cuda"``): what
        :func:`pipetrain.costs.worker_memory_bytes` adds to the gradients themselves."""
        return 0

    @property
    def changes_arithmetic(self) -> bool:
        """Does it compute something other than SGD's own sums (a lossy codec)?"""
        return False


@dataclass(frozen=True)
class Pipeline(Strategy):
    """Stages on workers, run by a :class:`PipelineSchedule` (PipeDream and others).

    Attributes:
        every_worker: price only plans for every worker, as a job started on them runs (``train``'s
            ``strategy="auto"``); else a plan for fewer where it is faster, as ``pipetrain plan`` shows it.
    """

    name: ClassVar[str] = "pipeline"
    data_parallel: ClassVar[bool] = False
    summary: ClassVar[str] = "stages on workers, run by a schedule (PipeDream and others)"
    every_worker: bool = False

    def synchronizer(self, ctx: SyncContext) -> GradSync | None:
        return replica_groups(ctx)

    def build(self, workers: int, minibatches: int, epoch: int = 0) -> Schedule:
        raise ValueError("a pipeline's action lists come from its schedule: schedule.build(replicas, minibatches)")

    def cannot_run(self, workers: int, batch_size: int, one_machine: bool) -> str:
        return "" if workers > 1 else "one worker has nothing to pipeline"

    def predict(self, profile: Profile, workers: int, link: Link, batch_size: int | None = None, *,
                minibatches: int | None = None, update_s: float | None = None,
                host: dict[str, float] | None = None) -> Priced:
        """PipeDream's best plan (§3.2) run by the ``pipedream`` schedule. A plan that puts the whole
        model on every worker is data parallelism: it competes as such, not as a pipeline."""
        chosen = best_plan(profile, propose(profile, workers, link.bandwidth_Bps if link.bandwidth_Bps < math.inf
                                            else 1e15), link, batch_size, minibatches or 32,
                           every_worker=self.every_worker)
        if len(chosen.stages) == 1:
            return Priced(0.0, self, chosen, f"the best plan is one stage on every worker ({chosen.samples_per_s:.0f} "
                                             "samples/s as `train --plan` runs it): data parallelism, competes as ddp")
        return Priced(chosen.samples_per_s, self, chosen)

    def options(self) -> dict[str, Any]:
        return {"strategy": self.name, "schedule": PipeDream.name}

    def sync_bytes(self, gradient_bytes: int, workers: int, device: str) -> int:
        """A replicated stage allreduces flat copies of its gradient (:func:`pipetrain.costs.allreduce_copy_bytes`)."""
        return int(allreduce_copy_bytes(gradient_bytes, workers))


@dataclass(frozen=True)
class _Allreduced(Strategy):
    """A data-parallel strategy that agrees on each gradient with an allreduce, priced by
    :func:`pipetrain.predict.predict_data_parallel` with the flags :meth:`prediction_flags` gives."""

    def prediction_flags(self) -> dict[str, Any]:
        """:func:`pipetrain.predict.predict_data_parallel`'s flags for this strategy."""
        raise NotImplementedError

    def predict(self, profile: Profile, workers: int, link: Link, batch_size: int | None = None, *,
                minibatches: int | None = None, update_s: float | None = None,
                host: dict[str, float] | None = None) -> Priced:
        found = predict_data_parallel(profile, workers, link, batch_size, **self.prediction_flags(),
                                      update_s=update_s, minibatches=minibatches or 32)
        return Priced(found.samples_per_s, self, detail=found)


@dataclass(frozen=True)
class DDP(_Allreduced):
    """PyTorch DistributedDataParallel: synchronous, bucket allreduces inside the backward."""

    name: ClassVar[str] = "ddp"
    summary: ClassVar[str] = "PyTorch DistributedDataParallel: synchronous, allreduce inside the backward"

    def shared_sync(self, ctx: SyncContext) -> GradSync:
        return ddp(ctx)

    def prediction_flags(self) -> dict[str, Any]:
        """Synchronous SGD (Pipe-SGD eq. 2) on the backend's allreduce, its buckets inside the backward."""
        return {"staleness": 1, "own_ring": False, "buckets_in_backward": True}

    def sync_bytes(self, gradient_bytes: int, workers: int, device: str) -> int:
        """DDP's buckets hold a flat copy of every gradient (``gradient_as_bucket_view`` is off); one
        worker has no DDP."""
        return gradient_bytes if workers > 1 else 0


@dataclass(frozen=True)
class PipeSGD(_Allreduced):
    """Pipe-SGD (Li et al., NeurIPS'18): the allreduce of minibatch t overlaps the compute of the next K-1.

    Args:
        staleness: K; minibatch t of an epoch takes its gradient at the weights after max(0, t-K+1)
            updates, and update j applies minibatch j-1's mean gradient (K = 2). 1 is synchronous SGD.
        compression: the codec inside the ring allreduce: None, ``"trunc16"`` (the upper 16 bits of each
            float32) or ``"quant8"`` (8 bits with a scale per group); float32 models only.
        warmup_epochs: the first epochs run with K = 1.
    """

    name: ClassVar[str] = "pipe-sgd"
    summary: ClassVar[str] = "Pipe-SGD: the allreduce of minibatch t overlaps the compute of t+1..t+K-1"
    staleness: int = 2
    compression: str | None = None
    warmup_epochs: int = 0

    def __post_init__(self) -> None:
        check_count(self.staleness, "staleness")
        check_count(self.warmup_epochs, "warmup_epochs", 0)
        get_codec(self.compression)  # a one-line error naming the codecs

    def shared_sync(self, ctx: SyncContext) -> GradSync:
        return pipe_sgd(ctx, self.compression)

    def prediction_flags(self) -> dict[str, Any]:
        """Pipe-SGD eq. 4-5 at its staleness K, on our own ring with its codec."""
        return {"staleness": self.staleness, "compression": self.compression, "own_ring": True}

    def options(self) -> dict[str, Any]:
        return {"strategy": self.name, "staleness": self.staleness,
                **({"compression": self.compression} if self.compression else {}),
                **({"warmup_epochs": self.warmup_epochs} if self.warmup_epochs else {})}

    def staleness_at(self, epoch: int) -> int:
        return 1 if epoch < self.warmup_epochs else self.staleness

    def sync_bytes(self, gradient_bytes: int, workers: int, device: str) -> int:
        """A flat buffer per minibatch whose gradient is in the ring or lent to ``.grad``: K of them (the
        ring's receive blocks, 1/p of it, left out). One worker sets aside the K-1 gradients taken
        before their update, not copies."""
        return (self.staleness if workers > 1 else self.staleness - 1) * gradient_bytes

    def check_model(self, model: nn.Module) -> None:
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        if get_codec(self.compression).lossy and dtypes != {torch.float32}:
            raise ValueError(f"compression={self.compression!r} works on float32 gradients, but the model's "
                             f"parameters are {', '.join(sorted(str(d) for d in dtypes))}; use a float32 model "
                             "or compression=None")

    @property
    def changes_arithmetic(self) -> bool:
        return get_codec(self.compression).lossy


@dataclass(frozen=True)
class CGDP(Strategy):
    """CPU-GPU data parallel: chunks of layers summed in shared host memory while the backward goes on.

    Args:
        chunk: layers per chunk (their gradients go to host memory together), or ``"auto"``: the
            paper's run-time search (:class:`pipetrain.strategies.chunks.ChunkSearch`).
    """

    name: ClassVar[str] = "cgdp"
    summary: ClassVar[str] = ("CPU-GPU data parallel: chunks of layers summed in shared host memory during the "
                              "backward (one machine, or hierarchical)")
    chunk: int | str = "auto"

    def __post_init__(self) -> None:
        if not (self.chunk == "auto" or (isinstance(self.chunk, int) and not isinstance(self.chunk, bool)
                                         and self.chunk >= 1)):
            raise ValueError(f"chunk={self.chunk!r}: give the layers per chunk (an integer >= 1) or 'auto' "
                             "(the run-time search)")

    def shared_sync(self, ctx: SyncContext) -> GradSync:
        return cgdp(ctx, self.chunk)

    def cannot_run(self, workers: int, batch_size: int, one_machine: bool) -> str:
        return super().cannot_run(workers, batch_size, one_machine) or (
            "" if one_machine else "CGDP sums in one machine's memory; the workers span machines")

    def predict(self, profile: Profile, workers: int, link: Link, batch_size: int | None = None, *,
                minibatches: int | None = None, update_s: float | None = None,
                host: dict[str, float] | None = None) -> Priced:
        """CGDP eq. 1-2 at its chunk size, or with ``"auto"`` at the size the model prices fastest
        (:func:`pipetrain.predict.cgdp.best_chunk`)."""
        costs = host_costs(profile, workers, host)
        if isinstance(self.chunk, int):
            found = predict_on_host(profile, workers, self.chunk, batch_size, costs, update_s, minibatches)
        else:
            found = best_chunk(profile, workers, batch_size, costs, update_s, minibatches)
        return Priced(found.samples_per_s, CGDP(chunk=found.chunk), detail=found)

    def options(self) -> dict[str, Any]:
        return {"strategy": self.name, "chunk": self.chunk}

    def sync_bytes(self, gradient_bytes: int, workers: int, device: str) -> int:
        """On the CPU, the pages of the machine's shared gradient memory a worker touches: its own slot, its
        share of the others' slots, and the two sums its ``.grad`` views (its own ``.grad`` is let go into
        them), about three gradients; on a GPU nothing: that memory is the host's. One worker uses none."""
        return 3 * gradient_bytes if device == "cpu" and workers > 1 else 0

    def check_host(self, model: nn.Module, local_workers: int) -> None:
        """Room in the machine's shared memory for its workers' gradients."""
        need = host_bytes(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
                          local_workers)
        if HOST_MEMORY.is_dir():
            st = os.statvfs(HOST_MEMORY)
            if need > st.f_bavail * st.f_frsize:
                raise ValueError(f"cgdp needs {need / 2**20:.0f} MiB of shared memory in {HOST_MEMORY} for "
                                 f"{local_workers} workers' gradients, but {st.f_bavail * st.f_frsize / 2**20:.0f} MiB "
                                 "are free; enlarge it (docker: --shm-size) or use another strategy")


@dataclass(frozen=True)
class Auto:
    """``strategy="auto"``: measure, predict every strategy and train the fastest.

    Args:
        allow_compression: may pick a codec that changes the arithmetic (Pipe-SGD's trunc16, quant8).
    """

    name: ClassVar[str] = "auto"
    summary: ClassVar[str] = ("profile, measure this machine, predict every strategy for the workers and train "
                              "the fastest")
    allow_compression: bool = False
