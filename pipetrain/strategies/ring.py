"""Ring allreduce with the codec inside the ring (Pipe-SGD §3.1 Fig. 2c and §3.2, Li et al. NeurIPS'18).

The gradient is cut into p equal blocks, one per rank of the group. Rank r of p, peers r-1 and r+1
(mod p), C = compress and D = decompress:

    reduce-scatter, steps s = 0 .. p-2       send C(blocks[r]) first; at step s receive block
                                             j = (r-s-1) mod p, send C(D(received) + blocks[j])
    all-gather,     steps s = 0 .. p-2       forward the final payloads unchanged: send the one
                                             of block (r+1-s) mod p (own at s = 0), receive block
                                             (r-s) mod p; write D(payload) of each into its block

so block j is the sequential recurrence over ranks j, j+1, ..., j+p-1 (mod p):

    acc_0 = C(g_j on rank j),   acc_k = C(D(acc_(k-1)) + g_j on rank j+k),   result = D(acc_(p-1)).

Rank r ends the reduce-scatter holding acc_(p-1) of block (r+1) mod p. Every rank, that owner
included, decodes the same final payloads, so all ranks end bitwise identical even with a lossy
codec. Each rank sends 2(p-1) payloads of one block each; only point-to-point ops are used, on uint8
payloads, so the ring runs on gloo and NCCL alike. A block moves in chunks, each reduced and sent on
as soon as it has arrived ([Note: chunks]); chunks are whole codec granules (quant8's scale groups),
so chunking changes no value.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.dist import wire_device
from pipetrain.strategies.compression import Codec

__all__ = ["allreduce", "block_size", "ring_allreduce", "ring_compute_seconds"]

CHUNK_BYTES = 1 << 20
"""[Note: chunks] A block travels as chunks of at most 1 MiB of payload, and at least
:data:`CHUNKS_PER_BLOCK` of them (none under :data:`MIN_CHUNK_BYTES`); each chunk goes on to the next
hop as soon as it has arrived and been reduced (the pipelined ring of Pipe-SGD Fig. 3a: a chunk's
decode, add and encode overlap the transfer of the chunks behind it). Three reasons: gloo moves one
large message between two ranks one direction at a time, so a block sent whole takes as long as
sending then receiving it, where pieces let both directions of a link run at once; the codec's work
on one chunk overlaps the transfer of the next instead of adding to the ring's time; and a block cut
into only one or two chunks leaves little to overlap, hence at least :data:`CHUNKS_PER_BLOCK`. Above
1 MiB, larger chunks gain nothing. ``pipetrain bench --systems pipe-sgd,pipe-sgd-quant8`` sets the
ring's measured time beside its model's, which prices the link alone."""
CHUNKS_PER_BLOCK = 8
MIN_CHUNK_BYTES = 1 << 16

def block_size(n: int, world: int, granule: int) -> int:
    """Elements per ring block: ceil(n / world) rounded up to a multiple of granule (>= granule)."""
    per_rank = -(-n // world)
    return max(granule, -(-per_rank // granule) * granule)


def allreduce(blocks: torch.Tensor, group: dist.ProcessGroup | None, codec: Codec,
              workspace: dict[str, torch.Tensor] | None = None) -> int:
    """Pipe-SGD's allreduce: :func:`ring_allreduce` (same arguments, same return value) for a lossy
    codec, which must sit inside the ring; for the identity codec, the backend's own ``all_reduce``.

    [Note: lossless allreduce] Without a codec the ring has nothing to do between hops but add, and
    gloo's ``all_reduce`` (a ring as well, in C++) does that with less CPU: on two emulated hosts,
    107 MB of gradient took 9-34% less of the process's CPU than our ring in 5 of 6 comparisons,
    in the same wall time (BENCHMARKS.md, "Where the allreduce's time goes"). Where the workers
    share cores, that CPU is taken from the compute the allreduce should hide behind. Its result is
    bitwise the same on every rank, as the ring's is, though not summed in the ring's order, so it
    is not the recurrence of the module docstring.
    """
    if codec.lossy:
        return ring_allreduce(blocks, group, codec, workspace)
    p, _, nbytes = _check(blocks, group, codec)
    if p > 1:
        dist.all_reduce(blocks, group=group)
    return 2 * (p - 1) * nbytes


def _check(blocks: torch.Tensor, group: dist.ProcessGroup | None, codec: Codec) -> tuple[int, int, int]:
    """(ranks, this rank, payload bytes of one block); raises ValueError on what the ring cannot take."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if r < 0:
        raise ValueError("ring_allreduce called on a rank that is not in the group")
    if blocks.dim() != 2 or blocks.shape[0] != p or not blocks.is_contiguous():
        raise ValueError(f"blocks must be a contiguous ({p}, b) tensor for a group of {p} ranks, "
                         f"got shape {tuple(blocks.shape)}")
    return p, r, codec.payload_bytes(blocks.shape[1], blocks.dtype)  # raises on a dtype or granule the codec refuses


def ring_allreduce(blocks: torch.Tensor, group: dist.ProcessGroup | None, codec: Codec,
                   workspace: dict[str, torch.Tensor] | None = None) -> int:
    """Sum ``blocks`` over the group's ranks in place, compressing every block sent with ``codec``.

    Args:
        blocks: a (world, b) contiguous float tensor: the caller's flat gradient padded with zeros
            to world * b elements, b a multiple of ``codec.granule`` (see ``block_size``).
        group: the ranks to reduce over (None: the default group). Every rank of it calls this.
        codec: how blocks travel; lossy codecs round each partial sum (module docstring).
        workspace: where the ring keeps its receive buffers from one call to the next (a caller that
            allreduces again and again keeps one dict); None: new buffers every call. A new buffer's
            pages fault in as it is first written, which costs an order of magnitude more CPU than
            writing them again, and a large model's ring needs twice its gradient in buffers.

    Returns:
        The payload bytes this rank sent: 2 (p-1) payloads of ``codec.payload_bytes(b)``.

    Raises:
        ValueError: this rank is not in ``group``, or ``blocks`` has the wrong shape or dtype.
        RuntimeError: from the point-to-point ops, e.g. when a peer died.
    """
    p, r, nbytes = _check(blocks, group, codec)
    b = blocks.shape[1]
    if p == 1:
        return 0
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    nxt, prv = ranks[(r + 1) % p], ranks[(r - 1) % p]  # P2P ops take global ranks

    staged = wire_device(blocks.device, group) != blocks.device

    def post(send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
        """One chunk of one hop: send to the next rank, receive from the previous, as one batch (so
        NCCL pairs them; every rank posts its (hop, chunk) batches in the same order). Where the
        backend cannot move the device's tensors (gloo on a GPU), both go through host memory."""
        if not staged:
            return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group=group),
                                           dist.P2POp(dist.irecv, recv, prv, group=group)])
        out, into = send.cpu(), torch.empty(recv.shape, dtype=recv.dtype)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt, group=group),
                                        dist.P2POp(dist.irecv, into, prv, group=group)])
        return [_Staged(works, out, into, recv)]

    chunks = _chunks(b, codec, blocks.dtype)
    if codec.lossy:
        bufs = [_buffer(workspace, f"payload{i}", chunks[-1][1].stop, blocks.device) for i in range(2)]
        _ring_coded(blocks, r, p, codec, chunks, post, bufs)
    else:
        recv = _buffer(workspace, "block", b * blocks.element_size(), blocks.device).view(blocks.dtype)
        _ring_raw(blocks, r, p, chunks, post, recv)
    return 2 * (p - 1) * nbytes


def _buffer(workspace: dict[str, torch.Tensor] | None, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` uint8 bytes on ``device``: ``workspace``'s under ``key`` when it holds them, else new
    (and kept there)."""
    held = None if workspace is None else workspace.get(key)
    if held is None or held.numel() != nbytes or held.device != device:
        held = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if workspace is not None:
            workspace[key] = held
    return held


Post = Callable[[torch.Tensor, torch.Tensor], list]
Chunk = tuple[slice, slice]  # elements of a block, bytes of its payload


def _chunks(b: int, codec: Codec, dtype: torch.dtype) -> list[Chunk]:
    """A block cut into pieces of payload, each a whole number of granules, with the slice of the
    block's payload each piece's payload takes (sizes: see [Note: chunks])."""
    target = min(CHUNK_BYTES, max(MIN_CHUNK_BYTES, codec.payload_bytes(b, dtype) // CHUNKS_PER_BLOCK))
    size = max(1, target // codec.payload_bytes(codec.granule, dtype)) * codec.granule
    out, at = [], 0
    for lo in range(0, b, size):
        n = codec.payload_bytes(min(size, b - lo), dtype)
        out.append((slice(lo, min(lo + size, b)), slice(at, at + n)))
        at += n
    return out


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _Staged:
    """A hop through host memory: once its send and receive are done, what arrived lands on the device."""

    def __init__(self, works: list[Any], sent: torch.Tensor, arrived: torch.Tensor, into: torch.Tensor) -> None:
        self.works, self.sent, self.arrived, self.into = works, sent, arrived, into  # ``sent`` lives until done

    def wait(self) -> None:
        _wait(self.works)
        self.into.copy_(self.arrived)


def _ring_raw(blocks: torch.Tensor, r: int, p: int, chunks: list[Chunk], post: Post, recv: torch.Tensor) -> None:
    """The ring for the identity codec: blocks travel as their own bytes; each chunk is added and
    sent on as soon as it arrives (into ``recv``, one block's elements)."""
    u8 = torch.uint8
    pending = [post(blocks[r][e].view(u8), recv[e].view(u8)) for e, _ in chunks]
    for h in range(2 * (p - 1)):
        for k, (e, _) in enumerate(chunks):
            _wait(pending[k])
            if h < p - 1:  # reduce-scatter: add the arriving partial sum of block j to ours
                j = (r - h - 1) % p
                blocks[j][e].add_(recv[e])  # = D(acc) + g_j: IEEE addition commutes
                if h < p - 2:
                    pending[k] = post(blocks[j][e].view(u8), recv[e].view(u8))
                else:  # block j = r+1 is complete here: all-gather hop 0 sends it, brings block r
                    pending[k] = post(blocks[j][e].view(u8), blocks[r][e].view(u8))
            elif h < 2 * (p - 1) - 1:  # all-gather: forward what arrived, receive the next block
                a = h - (p - 1)
                pending[k] = post(blocks[(r - a) % p][e].view(u8), blocks[(r - a - 1) % p][e].view(u8))


def _ring_coded(blocks: torch.Tensor, r: int, p: int, codec: Codec, chunks: list[Chunk], post: Post,
                bufs: list[torch.Tensor]) -> None:
    """The ring for a lossy codec: every hop carries payloads (``bufs``: two of one block's payload
    bytes, one arriving while the other leaves); each arriving chunk is decoded, added, re-encoded in
    place and sent on while later chunks still travel."""
    pending = []
    for e, q in chunks:
        codec.compress(blocks[r][e], out=bufs[1][q])
        pending.append(post(bufs[1][q], bufs[0][q]))
    # [Note: scratch] once encoded, rank r's own block is not read again until the all-gather brings
    # its final value, so its chunks hold each step's D(received) + g.
    scratch = blocks[r]
    for h in range(2 * (p - 1)):
        arrived, spare = bufs[h % 2], bufs[(h + 1) % 2]  # spare: what hop h sent, free once it is done
        for k, (e, q) in enumerate(chunks):
            _wait(pending[k])
            last = h == 2 * (p - 1) - 1
            if h < p - 1:  # reduce-scatter: acc = C(D(received) + g_j), in place
                j = (r - h - 1) % p
                codec.decompress(arrived[q], out=scratch[e]).add_(blocks[j][e])
                codec.compress(scratch[e], out=arrived[q])
                pending[k] = post(arrived[q], spare[q])
                if h == p - 2:  # the final payload of block j = r+1: its owner decodes it too
                    codec.decompress(arrived[q], out=blocks[j][e])
            else:  # all-gather: forward the final payload unchanged, decode it meanwhile
                if not last:
                    pending[k] = post(arrived[q], spare[q])
                codec.decompress(arrived[q], out=blocks[(r - (h - (p - 1))) % p][e])


def ring_compute_seconds(codec: Codec, elements: int, workers: int, dtype: torch.dtype = torch.float32,
                         repeats: int = 3) -> float:
    """Seconds of arithmetic one rank spends in one :func:`ring_allreduce` of ``elements`` over
    ``workers`` ranks, timed here without sending anything: the first encode, p-1 reduce steps
    (decode, add, encode; an add alone for ``none``) and p decodes of the final blocks (the one it
    reduced last, then the p-1 the all-gather brings). The median of ``repeats``; the γ of Pipe-SGD's
    ring model (:func:`pipetrain.costs.ring_allreduce_time`).
    """
    if workers < 2:
        return 0.0
    b = block_size(elements, workers, codec.granule)
    g, acc = torch.rand(b, dtype=dtype), torch.rand(b, dtype=dtype)
    payload = torch.empty(codec.payload_bytes(b, dtype), dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):  # the first run warms the allocator up
        t0 = time.perf_counter()
        if codec.lossy:
            codec.compress(g, out=payload)
            for _ in range(workers - 1):
                codec.decompress(payload, out=acc).add_(g)
                codec.compress(acc, out=payload)
            for _ in range(workers):
                codec.decompress(payload, out=acc)
        else:
            for _ in range(workers - 1):
                acc.add_(g)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])
