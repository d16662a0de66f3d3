"""``strategy="pipe-sgd"``: the allreduce of minibatch t runs on a communication thread while the
compute thread works on t+1 .. t+K-1 (Li et al., "Pipe-SGD: A Decentralized Pipelined SGD Framework
for Distributed Deep Net Training", NeurIPS 2018, §3.1 Algorithm 1 and Figure 1c).

The compute thread hands a minibatch's gradient over at ``A``: it is copied out of ``.grad`` into a
buffer of the synchronizer's own (the next backward writes ``.grad`` again), divided by the worker
count on the way (the copy's one pass over the gradient; a division after the sum would take another),
and queued. The communication thread reduces the queued buffers one after the other on a process
group only it uses: with a codec, by our ring allreduce, which compresses inside the ring (§3.2,
:mod:`pipetrain.strategies.ring`); without one, by the backend's own ``all_reduce``, which takes less
CPU ([Note: lossless allreduce] there). At ``S`` the compute thread waits for the mean and lends it to
``.grad`` as views for the ``U`` step.
Where the ``A``/``S``/``U`` actions go (the staleness K) is the schedule's business
(:func:`pipetrain.schedule.generators.stale_sync`); this module only moves gradients.

[Note: lent buffers] After ``wait(t)`` the parameters' ``.grad`` are views of t's buffer. The schedule
always runs ``U t`` right after ``S t`` and before the next ``A`` or ``S``, and ``U`` drops the views
(``zero_grad(set_to_none=True)``), so the buffer lent at one ``wait`` is taken back at the next call.
Buffers are reused, not reallocated: a fresh allocation of a large gradient costs page faults.

On a GPU the copies run on the compute stream and the ring on a stream of the communication thread,
ordered by CUDA events; on CPU the same code runs without streams.
"""
from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.strategies.base import GradSync, Mailbox, SyncContext, Weights
from pipetrain.strategies.compression import Codec, get_codec
from pipetrain.strategies.ring import allreduce, block_size


class RingSync(GradSync):
    """Mean gradients over every worker by an allreduce on a communication thread (the compressed ring
    with a codec).

    Args:
        group: a process group of all the data-parallel workers, used by the communication thread only.
        workers: the group's size.
        codec: what the ring compresses with (:mod:`pipetrain.strategies.compression`).
        device: where gradients live.
        timeout: seconds ``wait`` gives one sync before failing.

    Attributes:
        ring_seconds: how long each allreduce took on the communication thread.
        ring_spans: per allreduce, ``(minibatch, start, end)`` in ``time.perf_counter`` seconds (the
            clock of the worker's trace), from taking the job off the queue to the reduced gradient.
    """

    def __init__(self, group: dist.ProcessGroup, workers: int, codec: Codec, device: torch.device,
                 timeout: float) -> None:
        self.group, self.workers, self.codec, self.device, self.timeout = group, workers, codec, device, timeout
        self.bytes_sent = 0
        self.ring_seconds: list[float] = []
        self.ring_spans: list[tuple[int, float, float]] = []
        self._shapes: list[tuple[torch.Size, int]] | None = None  # per parameter: shape, numel
        self._block = 0
        self._jobs: queue.Queue[tuple[int, torch.Tensor, Any] | None] = queue.Queue()
        self._done = Mailbox(timeout)  # mb -> (reduced buffer, CUDA event or None)
        self._free: list[torch.Tensor] = []
        self._workspace: dict[str, torch.Tensor] = {}  # the ring's receive buffers, kept between allreduces
        self._lent: torch.Tensor | None = None
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pipetrain-ring")
        self._thread.start()

    # -- compute thread -------------------------------------------------------------------------------
    def start(self, mb: int, weights: Weights) -> None:
        """Copy ``mb``'s gradient divided by the worker count into a buffer of our own (one pass over
        it: the allreduce's sum is then the mean), clear ``.grad``, queue the allreduce."""
        params = _trainable(weights)
        buf = self._take(params)
        assert self._shapes is not None  # set by the first _take
        offset = 0
        for p, (_, numel) in zip(params, self._shapes):
            into = buf[offset:offset + numel]
            if p.grad is None:
                into.zero_()
            else:
                torch.div(p.grad.reshape(-1), self.workers, out=into)
            offset += numel
            p.grad = None
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        self._jobs.put((mb, buf, event))

    def wait(self, mb: int, weights: Weights) -> None:
        """Block until ``mb``'s mean gradient is reduced, then lend it to ``.grad`` (see [Note: lent
        buffers]).

        Raises:
            SyncError: the ring failed (a peer died) or took longer than ``timeout``.
        """
        buf, event = self._done.take(mb, f"the gradient allreduce of minibatch {mb}")
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        assert self._shapes is not None  # set by start, which queued this minibatch
        offset = 0
        for p, (shape, numel) in zip(_trainable(weights), self._shapes):
            p.grad = buf[offset:offset + numel].view(shape)
            offset += numel
        self._lent = buf

    def close(self) -> None:
        """Stop the communication thread once its queue is empty."""
        self._jobs.put(None)
        self._thread.join(self.timeout)

    def stats(self) -> dict[str, Any]:
        return {"ring_seconds": list(self.ring_seconds), "ring_spans": list(self.ring_spans)}

    def _take(self, params: list[torch.Tensor]) -> torch.Tensor:
        """A zeroed-padding buffer for one minibatch's gradient; the one lent to ``.grad`` comes back."""
        if self._shapes is None:
            dtypes = {p.dtype for p in params}
            if len(dtypes) != 1:
                raise ValueError(f"pipe-sgd reduces one flat gradient; the model's parameters mix dtypes "
                                 f"{sorted(map(str, dtypes))}: cast the model to one dtype")
            self._shapes = [(p.shape, p.numel()) for p in params]
            self._block = block_size(sum(p.numel() for p in params), self.workers, self.codec.granule)
        if self._lent is not None:
            self._free.append(self._lent)
            self._lent = None
        if self._free:
            return self._free.pop()
        # zeros: the padding after the gradient must stay zero (every ring sum of zeros is zero)
        return torch.zeros(self.workers * self._block, dtype=params[0].dtype, device=self.device)

    # -- communication thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                mb, buf, event = job
                t0 = time.perf_counter()
                if self._cuda:
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(event)  # type: ignore[union-attr]
                        done = self._reduce(buf)
                        done_event = torch.cuda.Event()
                        done_event.record(self._stream)
                    done_event.synchronize()
                else:
                    done, done_event = self._reduce(buf), None
                end = time.perf_counter()
                self.ring_seconds.append(end - t0)
                self.ring_spans.append((mb, t0, end))
                self._done.put(mb, (done, done_event))
        except BaseException as e:  # noqa: BLE001 - handed to the compute thread at its next wait
            self._done.fail(e)

    def _reduce(self, buf: torch.Tensor) -> torch.Tensor:
        self.bytes_sent += allreduce(buf.view(self.workers, self._block), self.group, self.codec, self._workspace)
        return buf


def _trainable(weights: Weights) -> list[torch.Tensor]:
    return [p for p in weights.values() if p.requires_grad]


def pipe_sgd(ctx: SyncContext, compression: str | None) -> GradSync:
    """The ``pipe-sgd`` strategy's synchronizer: a ring over all workers on a group of its own, with the
    codec ``compression`` inside."""
    workers = ctx.layout.world
    group = dist.new_group(list(range(workers)), timeout=timedelta(seconds=ctx.timeout))
    return RingSync(group, workers, get_codec(compression), ctx.device, ctx.timeout)
