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
payloads, so the ring runs on gloo and NCCL alike. Steps are not pipelined inside a block (Pipe-SGD
Fig. 3a): each reduce step waits for its whole block; only the all-gather decodes while it sends.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from pipetrain.strategies.compression import Codec

__all__ = ["block_size", "ring_allreduce"]

_Exchange = Callable[..., None]  # (send, recv, meanwhile=None): one hop of the ring


def block_size(n: int, world: int, granule: int) -> int:
    """Elements per ring block: ceil(n / world) rounded up to a multiple of granule (>= granule)."""
    per_rank = -(-n // world)
    return max(granule, -(-per_rank // granule) * granule)


def ring_allreduce(blocks: torch.Tensor, group: dist.ProcessGroup | None, codec: Codec) -> int:
    """Sum ``blocks`` over the group's ranks in place, compressing every block sent with ``codec``.

    Args:
        blocks: a (world, b) contiguous float tensor: the caller's flat gradient padded with zeros
            to world * b elements, b a multiple of ``codec.granule`` (see ``block_size``).
        group: the ranks to reduce over (None: the default group). Every rank of it calls this.
        codec: how blocks travel; lossy codecs round each partial sum (module docstring).

    Returns:
        The payload bytes this rank sent: 2 (p-1) payloads of ``codec.payload_bytes(b)``.

    Raises:
        ValueError: this rank is not in ``group``, or ``blocks`` has the wrong shape or dtype.
        RuntimeError: from the point-to-point ops, e.g. when a peer died.
    """
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if r < 0:
        raise ValueError("ring_allreduce called on a rank that is not in the group")
    if blocks.dim() != 2 or blocks.shape[0] != p or not blocks.is_contiguous():
        raise ValueError(f"blocks must be a contiguous ({p}, b) tensor for a group of {p} ranks, "
                         f"got shape {tuple(blocks.shape)}")
    b = blocks.shape[1]
    nbytes = codec.payload_bytes(b, blocks.dtype)  # raises on a dtype or granule the codec refuses
    if p == 1:
        return 0
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    nxt, prv = ranks[(r + 1) % p], ranks[(r - 1) % p]  # P2P ops take global ranks

    def exchange(send: torch.Tensor, recv: torch.Tensor,
                 meanwhile: Callable[[], object] | None = None) -> None:
        """Send one payload to the next rank, receive one from the previous; run ``meanwhile``
        while they travel (it must not touch ``recv`` nor write ``send``)."""
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group=group),
                                        dist.P2POp(dist.irecv, recv, prv, group=group)])
        if meanwhile is not None:
            meanwhile()
        for work in works:
            work.wait()

    if not codec.lossy:
        _ring_raw(blocks, r, p, exchange)
    else:
        _ring_coded(blocks, r, p, codec, nbytes, exchange)
    return 2 * (p - 1) * nbytes


def _ring_raw(blocks: torch.Tensor, r: int, p: int, exchange: _Exchange) -> None:
    """The ring for the identity codec: blocks travel as their own bytes, without copies."""
    u8 = torch.uint8
    recv = torch.empty_like(blocks[0])
    send = blocks[r]
    for s in range(p - 1):
        exchange(send.view(u8), recv.view(u8))
        j = (r - s - 1) % p
        send = blocks[j].add_(recv)  # = D(acc) + g_j: IEEE addition commutes
    for s in range(p - 1):  # all-gather straight into the blocks
        exchange(blocks[(r + 1 - s) % p].view(u8), blocks[(r - s) % p].view(u8))


def _ring_coded(blocks: torch.Tensor, r: int, p: int, codec: Codec, nbytes: int,
                exchange: _Exchange) -> None:
    """The ring for a lossy codec: every hop carries a payload; partial sums are re-encoded."""
    send = torch.empty(nbytes, dtype=torch.uint8, device=blocks.device)
    recv = torch.empty_like(send)
    codec.compress(blocks[r], out=send)
    # [Note: scratch] after its first send, rank r's own block is not read again until the
    # all-gather overwrites it with the final value, so it holds each step's D(received) + g.
    scratch = blocks[r]
    for s in range(p - 1):
        exchange(send, recv)  # both done: send may be overwritten, recv read
        j = (r - s - 1) % p
        codec.decompress(recv, out=scratch).add_(blocks[j])
        codec.compress(scratch, out=send)
    # send holds the final payload of block r+1. Each all-gather step forwards the payload that
    # arrived last and decodes it while it travels (both only read it), the owner's own included,
    # so every rank writes D(payload) of the same payloads.
    for s in range(p - 1):
        exchange(send, recv, functools.partial(codec.decompress, send, blocks[(r + 1 - s) % p]))
        send, recv = recv, send
    codec.decompress(send, out=blocks[(r + 2) % p])  # the last arrival


def ring_compute_seconds(codec: Codec, elements: int, workers: int, dtype: torch.dtype = torch.float32,
                         repeats: int = 3) -> float:
    """Seconds of arithmetic one rank spends in one :func:`ring_allreduce` of ``elements`` over
    ``workers`` ranks, timed here without sending anything: the first encode, p-1 reduce steps
    (decode, add, encode; an add alone for ``none``) and p-1 all-gather decodes. The median of
    ``repeats``; the γ of Pipe-SGD's ring model (:func:`pipetrain.costs.ring_allreduce_time`).
    """
    import statistics
    import time

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
            for _ in range(workers - 1):
                codec.decompress(payload, out=acc)
        else:
            for _ in range(workers - 1):
                acc.add_(g)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])
