"""Point-to-point transport between neighbouring stages, on torch.distributed (gloo or NCCL).

Each directed edge (worker a -> worker b) gets its own two-rank process group, so the two directions
of a link never wait on each other and NCCL never sees two threads on one communicator. A sender
thread per outgoing edge and a receiver thread per incoming edge move tensors while the compute
thread works; the compute thread only enqueues sends and picks up what has arrived.

Each message is a fixed-size int64 header, then the tensors::

    [mb, micro, version, is_tuple, n, channel, cut, dtype_0, ndim_0, *shape_0, dtype_1, ...]

so shapes and dtypes cross with the data and no stage needs a shape spec. ``n == -1`` closes the edge.
``channel`` keeps apart what one edge carries: a cut's activations or gradients (0), or the tied
parameters' gradients and values (:mod:`pipetrain.runtime.tied`). ``cut`` names the stage boundary a
message crosses where a worker holds several stages (-1 otherwise): one edge then carries several
cuts (:mod:`pipetrain.runtime.multi`).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist

from pipetrain.errors import first_line
from pipetrain.runtime.dist import wire_device

HEADER_LEN = 128
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_CLOSE = -1


class PeerError(RuntimeError):
    """A neighbour died or went silent; the message names its stage and rank."""


@dataclass
class Message:
    """Tensors of one cut for one (micro)batch, with the weight version the input stage used."""

    mb: int
    micro: int | None
    version: int
    tensors: list[torch.Tensor]
    is_tuple: bool
    channel: int = 0
    cut: int = -1


def _encode(msg: Message | None, device: torch.device) -> torch.Tensor:
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    if msg is None:
        head[4] = _CLOSE
        return head.to(device)
    vals = [msg.mb, -1 if msg.micro is None else msg.micro, msg.version, int(msg.is_tuple), len(msg.tensors),
            msg.channel, msg.cut]
    for t in msg.tensors:
        vals += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(vals) > HEADER_LEN:
        raise ValueError(f"a cut of {len(msg.tensors)} tensors is too large for the {HEADER_LEN}-int header")
    head[:len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return head.to(device)


def _decode(head: torch.Tensor) -> tuple[int, int | None, int, bool, int, int, list[tuple[torch.dtype, list[int]]]]:
    h = head.tolist()
    specs, i = [], 7
    for _ in range(max(h[4], 0)):
        dtype, ndim = _DTYPES[h[i]], h[i + 1]
        specs.append((dtype, h[i + 2:i + 2 + ndim]))
        i += 2 + ndim
    return h[0], None if h[1] < 0 else h[1], h[2], bool(h[3]), h[5], h[6], specs if h[4] >= 0 else None  # type: ignore[return-value]


class Channel(Protocol):
    """What a worker needs of its transport: :class:`Transport`, or a stand-in that runs a worker
    without its neighbours (:func:`pipetrain.runtime.solo.run_stage_alone`)."""

    def send(self, peer: int, msg: Message) -> None: ...

    def recv(self, peer: int, mb: int, micro: int | None, what: str, channel: int = 0) -> Message: ...


class Transport:
    """Asynchronous sends and receives between this worker and its neighbours.

    Args:
        rank: this worker's global rank.
        edges: every directed edge (src, dst) of the job, identical on all ranks; a group is made
            for each, collectively, so every rank must pass the same list.
        describe: maps a rank to the words that name it in errors, e.g. ``"stage 1 (rank 1)"``.
        device: where tensors live: the worker's GPU or the CPU. Received tensors are placed there;
            gloo moves a GPU's tensors through host memory (:func:`pipetrain.runtime.dist.wire_device`).
        timeout: seconds to wait for a message before declaring the peer silent.
    """

    def __init__(self, rank: int, edges: list[tuple[int, int]], describe, device: torch.device,
                 timeout: float) -> None:
        self.rank, self.device, self.timeout, self.describe = rank, device, timeout, describe
        self._groups = {e: dist.new_group(list(e)) for e in sorted(edges)}
        self.wire = wire_device(device)  # where the backend takes the tensors from and puts them
        self._inbox: dict[tuple[int, int, int, int, int | None], Message] = {}
        self._cond = threading.Condition()
        self._errors: dict[int, BaseException] = {}
        self._closed: set[int] = set()
        self._out: dict[int, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        self.bytes_sent = 0  # tensor payload, headers excluded; updated by the compute thread
        for (src, dst), group in self._groups.items():
            if src == rank:
                self._out[dst] = queue.Queue()
                self._start(self._send_loop, dst, group)
            elif dst == rank:
                self._start(self._recv_loop, src, group)

    def _start(self, target, peer: int, group) -> None:
        t = threading.Thread(target=target, args=(peer, group), daemon=True,
                             name=f"pipetrain-{target.__name__}-{peer}")
        t.start()
        self._threads.append(t)

    def _send_loop(self, peer: int, group) -> None:
        try:
            while True:
                msg = self._out[peer].get()
                dist.send(_encode(msg, self.wire), peer, group=group)
                if msg is None:
                    return
                for t in msg.tensors:
                    dist.send(t.to(self.wire), peer, group=group)
        except BaseException as e:  # noqa: BLE001 - handed to the compute thread
            with self._cond:
                self._errors[peer] = e
                self._cond.notify_all()

    def _recv_loop(self, peer: int, group) -> None:
        try:
            while True:
                head = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.wire)
                dist.recv(head, peer, group=group)
                mb, micro, version, is_tuple, channel, cut, specs = _decode(head.cpu())
                if specs is None:
                    with self._cond:
                        self._closed.add(peer)
                        self._cond.notify_all()
                    return
                tensors = []
                for dtype, shape in specs:
                    t = torch.empty(shape, dtype=dtype, device=self.wire)
                    dist.recv(t, peer, group=group)
                    tensors.append(t.to(self.device))
                with self._cond:
                    self._inbox[(peer, channel, cut, mb, micro)] = Message(mb, micro, version, tensors, is_tuple, channel,
                                                                           cut)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001
            with self._cond:
                self._errors[peer] = e
                self._cond.notify_all()

    def send(self, peer: int, msg: Message) -> None:
        """Queue ``msg`` for ``peer``; returns at once (the tensors must not change afterwards)."""
        if peer in self._errors:
            self._raise(peer, f"sending minibatch {msg.mb}")
        tensors = [t.detach().contiguous() for t in msg.tensors]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        self._out[peer].put(replace(msg, tensors=tensors))

    def recv(self, peer: int, mb: int, micro: int | None, what: str, channel: int = 0, cut: int = -1) -> Message:
        """Wait for (mb, micro) from ``peer`` on ``channel`` (the cut's channel carries one kind per
        edge: activations or gradients; one per ``cut`` where a worker holds several stages).

        Raises:
            PeerError: the peer's connection broke, or nothing came within the timeout.
        """
        key = (peer, channel, cut, mb, micro)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while key not in self._inbox:
                if peer in self._errors or peer in self._closed:
                    self._raise(peer, f"waiting for {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(f"{self.describe(peer)} went silent: nothing for {self.timeout:g}s while "
                                    f"{self.describe(self.rank)} waited for {what}")
                self._cond.wait(min(left, 1.0))
            return self._inbox.pop(key)

    def _raise(self, peer: int, doing: str) -> None:
        err = self._errors.get(peer)
        reason = "closed its connection" if err is None else first_line(err)
        raise PeerError(f"{self.describe(peer)} went silent while {self.describe(self.rank)} was {doing}: "
                        f"{reason}")

    def close(self) -> None:
        """Send the close marker on every edge and wait for the queues to drain."""
        for q in self._out.values():
            q.put(None)
        deadline = time.monotonic() + self.timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for peer in self._errors:
            self._raise(peer, "finishing")
