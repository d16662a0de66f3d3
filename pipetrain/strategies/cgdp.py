"""``strategy="cgdp"``: CPU-GPU data parallel training (Le et al., "Involving CPUs into Multi-GPU Deep
Learning", ICPE'18, §3-4).

A layer's gradient does not change once the backward pass has made it, so the workers of one machine
do not wait for the end of the backward to agree on it. The paper's steps, as run here:

* B-3-1: when the last parameter of a chunk of layers has its gradient (a post-accumulate hook),
  the chunk goes to *host memory shared by the machine's workers* (the worker's own slot of a file in
  /dev/shm): on a GPU by an asynchronous copy on a D2H stream into pinned memory, on CPU by the
  worker's summing thread, off the backward's path; the local ``.grad`` is let go.
* the summing threads (one per worker: the machine's CPUs) wait until every worker has copied the
  chunk, then each sums its 1/L share of it over the L workers in rank order, into a shared sum,
  while autograd goes on with earlier layers;
* B-2-0-2 / B-5-1: at each later hook the compute thread takes back the chunks whose sum is done
  (on a GPU: an asynchronous copy to the device; on CPU ``.grad`` simply views the shared sum), and
  at ``S`` it drains the rest, before the ``U`` step. There is no server worker.

Signals between the workers go through ``torch.distributed`` (two 1-element allreduces per chunk, on
a process group only the summing threads use); data goes through shared memory only. Every element
of the sum is added in the same fixed order (rank order; across machines, machine by machine) by
whichever worker sums it, so the result is bitwise the same for every chunk size and every arrival
order, and on every worker.

Several machines (torchrun, ``LOCAL_WORLD_SIZE`` workers each): each machine sums in its own host
memory, then the workers with the same local rank all-gather their shares across machines and add
them in machine order (hierarchical; ``torch.distributed`` between machines).

Chunks and the run-time chunk search are :mod:`pipetrain.strategies.chunks` (§4).
"""
from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.layers import LayeredModel, LayerError
from pipetrain.runtime.dist import local_workers
from pipetrain.strategies.base import GradSync, Mailbox, SyncContext, Weights
from pipetrain.strategies.chunks import ChunkSearch, chunk_layout
from pipetrain.timing import median_seconds

HOST_MEMORY = Path("/dev/shm")
"""Where the machine's workers share their gradients (a RAM file system on Linux)."""


def layer_parameters(module: nn.Module) -> list[list[str]]:
    """Names of the trainable parameters of each layer that has some, in forward order.

    Layers come from :class:`pipetrain.layers.LayeredModel`; a parameter used by several layers
    belongs to the first. For a module fx cannot trace, each submodule that owns parameters is a
    layer, in registration order. Trainable parameters no layer reaches form one last layer.
    """
    try:
        layers = LayeredModel(module)
        found = [[n for n, p in layers.stage(k, k).named_parameters() if p.requires_grad] for k in range(len(layers))]
    except LayerError:
        found = [[f"{prefix}.{n}" if prefix else n for n, p in m.named_parameters(recurse=False) if p.requires_grad]
                 for prefix, m in module.named_modules()]
    seen: set[str] = set()
    out = []
    for names in found:
        own = [n for n in names if n not in seen]
        seen.update(own)
        if own:
            out.append(own)
    rest = [n for n, p in module.named_parameters() if p.requires_grad and n not in seen]
    return out + ([rest] if rest else [])


def host_bytes(parameter_bytes: int, local_workers: int) -> int:
    """Shared host memory CGDP takes on one machine: a slot per worker and a double-buffered sum."""
    return parameter_bytes * (local_workers + 2) + 64 * (local_workers + 4)


class _HostBuffer:
    """The machine's shared gradient memory: ``slots[r]`` (worker r's copy), ``total[parity]`` (the
    sum; two, so a fast worker's next iteration never overwrites a sum a slow one still reads) and
    ``times[r]`` (each worker's last iteration seconds, for the chunk search). Local rank 0 creates
    the file, every worker maps it, then the file is unlinked: nothing is left behind, even after a
    crash."""

    def __init__(self, numel: int, dtype: torch.dtype, local: int, local_rank: int, group: Any,
                 first_rank: int) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        offsets, at = [], 0
        for size in (8 * local, itemsize * numel * local, itemsize * numel * 2):
            offsets.append(at)
            at += -(-size // 64) * 64
        box: list[Any] = [None]
        if local_rank == 0:
            path = HOST_MEMORY / f"pipetrain-cgdp-{uuid.uuid4().hex}"
            with open(path, "wb") as f:
                f.truncate(at)
            box[0] = str(path)
        dist.broadcast_object_list(box, src=first_rank, group=group)
        raw = torch.from_file(box[0], shared=True, size=at, dtype=torch.uint8)
        dist.barrier(group=group)  # every worker has it mapped
        if local_rank == 0:
            os.unlink(box[0])
        self.raw = raw
        self.times = raw[offsets[0]:offsets[0] + 8 * local].view(torch.float64)
        self.slots = raw[offsets[1]:offsets[1] + itemsize * numel * local].view(dtype).view(local, numel)
        self.total = raw[offsets[2]:offsets[2] + itemsize * numel * 2].view(dtype).view(2, numel)


class HostSum(GradSync):
    """CGDP's synchronizer: chunks of gradients summed in shared host memory during the backward.

    Args:
        ctx: this worker's context.
        chunk: the chunk size (layers per chunk) or ``"auto"`` (:class:`pipetrain.strategies.chunks.ChunkSearch`).
        local, local_rank: workers on this machine, and this worker's index among them.
        group: the process group of this machine's workers, used by the summing thread only.
        across: the group of the workers with this local rank on every machine, or None on one machine.
        machines: how many machines.

    Attributes:
        chunks: the chunk size each iteration ran with.
        search: the chunk search (``"auto"``), else None.
    """

    def __init__(self, ctx: SyncContext, chunk: int | str, local: int, local_rank: int, group: Any, across: Any,
                 machines: int) -> None:
        self.chunk = chunk
        self.ctx, self.local, self.local_rank, self.group, self.across = ctx, local, local_rank, group, across
        self.machines, self.workers = machines, local * machines
        self.bytes_sent = 0
        self.chunks: list[int] = []
        self.search: ChunkSearch | None = None
        self._cuda = ctx.device.type == "cuda"
        # (iteration, chunk, its element range, last of the iteration?, CUDA event or None, CPU gradients)
        self._jobs: queue.Queue[tuple[int, int, tuple[int, int], bool, Any, list] | None] = queue.Queue()
        self._done = Mailbox(ctx.timeout)  # (iteration, chunk) -> slowest iteration time or None
        self._flag = torch.zeros(1)
        self._stamp = 0  # iterations so far
        self._last_sent: float | None = None
        self._slowest: float | None = None  # this iteration's slowest worker time, once its last chunk is back

    # -- set-up ----------------------------------------------------------------------------------
    def wrap(self, module: nn.Module) -> nn.Module:
        """Map this model's layers onto the shared host memory and hook every parameter."""
        params = dict(module.named_parameters())
        # flat order: layers in backward order, so every chunk is one contiguous range
        self._layers = [[params[n] for n in names] for names in reversed(layer_parameters(module))]
        flat = [p for layer in self._layers for p in layer]
        if not flat:
            raise ValueError(f"cgdp: {type(module).__name__} has no trainable parameters, so nothing to sum")
        dtypes = {p.dtype for p in flat}
        if len(dtypes) != 1:
            raise ValueError(f"cgdp sums one flat gradient; the model's parameters mix dtypes "
                             f"{sorted(map(str, dtypes))}: cast the model to one dtype")
        self._offset: dict[torch.Tensor, int] = {}
        at = 0
        self._layer_range = []
        for layer in self._layers:
            start = at
            for p in layer:
                self._offset[p] = at
                at += p.numel()
            self._layer_range.append((start, at))
        self.numel = at
        self._host = _HostBuffer(at, flat[0].dtype, self.local, self.local_rank, self.group,
                                 self.ctx.rank - self.local_rank)
        if self._cuda:
            self._d2h, self._h2d = torch.cuda.Stream(self.ctx.device), torch.cuda.Stream(self.ctx.device)
            raw = self._host.raw  # pinned, so the copies to and from the host are asynchronous
            torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0)
        for p in flat:
            p.register_post_accumulate_grad_hook(self._ready)
        chunk = self.chunk
        if chunk in (None, "auto"):
            self.search = ChunkSearch(len(self._layers))
            chunk = self.search.chunk
        self._use(int(chunk))
        self._thread = threading.Thread(target=self._sum_loop, daemon=True, name="pipetrain-host-sum")
        self._thread.start()
        return module

    def _use(self, chunk: int) -> None:
        """Group the layers into chunks of ``chunk`` for the next iteration."""
        self._chunk_size = chunk
        layout = chunk_layout(len(self._layers), chunk)
        self._chunks = [[p for i in ids for p in self._layers[i]] for ids in layout]
        self._chunk_of: dict[torch.Tensor, int] = {p: c for c, ps in enumerate(self._chunks) for p in ps}
        self._ranges = [(self._layer_range[ids[0]][0], self._layer_range[ids[-1]][1]) for ids in layout]
        self._reset()

    def _reset(self) -> None:
        self._left = [len(ps) for ps in self._chunks]  # parameters still without a gradient
        self._sent: list[int] = []  # chunks handed to the summing thread, in order
        self._back = 0  # chunks taken back so far

    # -- compute thread ----------------------------------------------------------------------------
    def _ready(self, p: torch.Tensor) -> None:
        """Post-accumulate hook: count ``p`` in; send its chunk once complete (B-3-1); take back the
        chunks already summed (B-2-0-2)."""
        c = self._chunk_of[p]
        self._left[c] -= 1
        if self._left[c] == 0:
            self._send(c)
        while self._back < len(self._sent) and self._done.ready((self._stamp, self._sent[self._back])):
            self._take_back()

    def _send(self, c: int) -> None:
        """Hand chunk ``c``'s gradients over for the host: on a GPU, an asynchronous copy into this
        worker's pinned host slot on the D2H stream; on CPU the gradients themselves (the summing
        thread copies them into the shared slot, off the backward's path). ``.grad`` is let go."""
        event, grads = None, []
        for p in self._chunks[c]:
            grads.append((self._offset[p], p.numel(), p.grad))
            p.grad = None  # the host holds the gradient now
        if self._cuda:
            slot = self._host.slots[self.local_rank]
            # the compute stream is read before the context makes the D2H stream current: the
            # copies wait for the kernels that made these gradients
            self._d2h.wait_stream(torch.cuda.current_stream(self.ctx.device))
            with torch.cuda.stream(self._d2h):
                for offset, n, g in grads:
                    if g is None:
                        slot[offset:offset + n].zero_()
                    else:
                        slot[offset:offset + n].copy_(g.reshape(-1), non_blocking=True)
                        g.record_stream(self._d2h)
                event = torch.cuda.Event()
                event.record(self._d2h)
            grads = []
        self._left[c] = -1  # sent
        self._sent.append(c)
        if len(self._sent) == len(self._chunks):  # this worker's iteration time, for the chunk search
            now = time.perf_counter()
            self._host.times[self.local_rank] = now - self._last_sent if self._last_sent is not None else -1.0
            self._last_sent = now
        self._jobs.put((self._stamp, c, self._ranges[c], c == len(self._chunks) - 1, event, grads))

    def start(self, mb: int, weights: Weights) -> None:
        """At ``A`` (the backward is over): send every chunk a parameter without a gradient held back."""
        for c in range(len(self._chunks)):
            if self._left[c] >= 0:
                self._send(c)

    def wait(self, mb: int, weights: Weights) -> None:
        """At ``S``: take back every chunk (B-5-1), then let the chunk search pick the next size."""
        while self._back < len(self._sent):
            self._take_back()
        if self._cuda:
            torch.cuda.current_stream(self.ctx.device).wait_stream(self._h2d)
        self.chunks.append(self._chunk_size)
        self._stamp += 1
        slowest, self._slowest = self._slowest, None
        # the last chunk may have come back in a hook or here: either way every worker has its time
        if self.search is not None and slowest is not None and slowest >= 0:
            # every worker feeds the same (slowest) time, so all pick the same chunk size
            self._use(self.search.record(slowest))
        else:
            self._reset()

    def _take_back(self) -> None:
        """The next sent chunk's sum onto ``.grad``: views of the shared sum on CPU, a copy on a GPU; the
        iteration's last chunk also brings the slowest worker's iteration time."""
        c = self._sent[self._back]
        slowest = self._done.take((self._stamp, c), f"the host gradient sum of chunk {c} of iteration {self._stamp}")
        if slowest is not None:
            self._slowest = slowest
        total = self._host.total[self._stamp % 2]
        if self._cuda:
            # The new .grad comes from the compute stream's pool, where the block may have just been
            # freed by kernels still queued there: the copy into it waits for them.
            self._h2d.wait_stream(torch.cuda.current_stream(self.ctx.device))
        for p in self._chunks[c]:
            view = total[self._offset[p]:self._offset[p] + p.numel()].view(p.shape)
            if self._cuda:
                p.grad = torch.empty_like(p)
                with torch.cuda.stream(self._h2d):
                    p.grad.copy_(view, non_blocking=True)
            else:
                p.grad = view
        self._back += 1

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(self.ctx.timeout)

    def stats(self) -> dict[str, Any]:
        """The chunk size of every iteration, and the search's outcome."""
        out: dict[str, Any] = {"chunks": list(self.chunks)}
        if self.search is not None:
            out["search"] = {"best": self.search.best, "done": self.search.done, "interval": self.search.interval,
                             "iterations": self.search.iterations, "trials": self.search.trials}
        return out

    # -- summing thread ------------------------------------------------------------------------------
    def _sum_loop(self) -> None:
        arrived: dict[tuple[int, int], tuple[tuple[int, int], bool, Any, list]] = {}
        expect = (0, 0)  # (iteration, chunk): every worker sums its chunks in this order
        try:
            while (job := self._jobs.get()) is not None:
                stamp, c, span, last, event, grads = job
                arrived[(stamp, c)] = (span, last, event, grads)
                while expect in arrived:
                    span, last, event, grads = arrived.pop(expect)
                    if event is not None:
                        event.synchronize()
                    slot = self._host.slots[self.local_rank]
                    for offset, n, g in grads:
                        if g is None:  # a parameter the backward did not reach: a zero gradient
                            slot[offset:offset + n].zero_()
                        else:
                            slot[offset:offset + n].copy_(g.reshape(-1))
                    del grads
                    self._done.put(expect, self._sum(expect[0], span, last))
                    expect = (expect[0] + 1, 0) if last else (expect[0], expect[1] + 1)
        except BaseException as e:  # noqa: BLE001 - handed to the compute thread at its next take
            self._done.fail(e)

    def _sum(self, stamp: int, span: tuple[int, int], last: bool) -> float | None:
        """Sum this worker's share of a chunk's elements ``span`` over the machine's workers, in rank
        order; with the iteration's last chunk, also agree on the slowest worker's iteration time."""
        dist.all_reduce(self._flag, group=self.group)  # every worker has copied this chunk
        lo, hi = span
        share = -(-(hi - lo) // self.local)
        s = slice(min(hi, lo + self.local_rank * share), min(hi, lo + (self.local_rank + 1) * share))
        slots, out = self._host.slots, self._host.total[stamp % 2][s]
        if self.local == 1:
            out.copy_(slots[0][s])
        else:
            torch.add(slots[0][s], slots[1][s], out=out)
            for r in range(2, self.local):
                out.add_(slots[r][s])
        if self.across is not None:
            self._add_machines(out)
        out.div_(self.workers)
        slowest = float(self._host.times.max()) if last else None
        if last and self.across is not None:
            t = torch.tensor([slowest])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.across)
            slowest = float(t)
        dist.all_reduce(self._flag, group=self.group)  # every share of chunk c is summed
        return slowest

    def _add_machines(self, out: torch.Tensor) -> None:
        """Replace this machine's sum of a share by the sum over machines, added in machine order."""
        parts = [torch.empty_like(out) for _ in range(self.machines)]
        dist.all_gather(parts, out.contiguous(), group=self.across)
        self.bytes_sent += out.numel() * out.element_size() * (self.machines - 1)
        out.copy_(parts[0])
        for part in parts[1:]:
            out.add_(part)


def cgdp(ctx: SyncContext, chunk: int | str) -> GradSync:
    """The ``cgdp`` strategy's synchronizer at ``chunk`` layers per chunk (or ``"auto"``), with its process groups (made collectively, in order).

    The machine's workers are ``LOCAL_WORLD_SIZE`` consecutive ranks (torchrun's numbering; locally
    launched workers are all on this machine).

    Raises:
        ValueError: the world size is not a multiple of the workers per machine.
    """
    world = ctx.layout.world
    local = local_workers(world)
    if world % local:
        raise ValueError(f"cgdp needs the same number of workers on every machine; {world} workers in all "
                         f"but LOCAL_WORLD_SIZE={local}")
    machines = world // local
    timeout = timedelta(seconds=ctx.timeout)
    # gloo: the signals and the shares are host tensors, whatever the job's backend
    groups = [dist.new_group(list(range(m * local, (m + 1) * local)), timeout=timeout, backend="gloo")
              for m in range(machines)]
    across = [dist.new_group([m * local + i for m in range(machines)], timeout=timeout, backend="gloo")
              for i in range(local)] if machines > 1 else None
    machine, local_rank = divmod(ctx.rank, local)
    return HostSum(ctx, chunk, local, local_rank, groups[machine], across[local_rank] if across else None, machines)


def measure_host_costs(elements: int, local: int, dtype: torch.dtype = torch.float32,
                       repeats: int = 3) -> dict[str, float]:
    """Seconds per gradient byte of the host work of :class:`HostSum`, timed here on this machine
    with the current thread count (medians of ``repeats`` after a warm-up), as the cost model's inputs:

    * ``copy_s_per_byte``: a worker copying a chunk into its host slot;
    * ``sum_s_per_byte``: a worker summing its 1/``local`` share of a chunk over ``local`` slots and
      dividing.

    Both run on the worker's summing thread: with the two signals, they are a chunk's t_aa.
    """
    n = max(local, elements)
    slots = torch.rand(local, n, dtype=dtype)
    grad, out = torch.rand(n, dtype=dtype), torch.empty(-(-n // local), dtype=dtype)
    share = out.numel()

    def copy() -> None:
        slots[0].copy_(grad)

    def add() -> None:
        if local == 1:
            out.copy_(slots[0][:share])
        else:
            torch.add(slots[0][:share], slots[1][:share], out=out)
            for r in range(2, local):
                out.add_(slots[r][:share])
        out.div_(local)

    nbytes = n * slots.element_size()
    return {"copy_s_per_byte": median_seconds(copy, repeats) / nbytes,
            "sum_s_per_byte": median_seconds(add, repeats) / nbytes}
