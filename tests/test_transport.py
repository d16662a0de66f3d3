"""The stage-to-stage transport: messages arrive whole and in their own slots whatever their shapes do.

The sequence below keeps shapes, changes them, changes dtypes and tensor counts, and mixes channels
and cuts: every tensor must come through bit for bit with its header's fields, taken in any order.
"""
import datetime

import pytest
import torch
import torch.distributed as dist

from pipetrain.runtime.launch import spawn
from pipetrain.runtime.transport import Message, PeerError, Transport

F32, I64 = torch.float32, torch.int64
# (channel, cut, specs of the message's tensors)
SEQUENCE = [
    (0, -1, [(F32, (4, 3))]), (0, -1, [(F32, (4, 3))]), (0, -1, [(F32, (4, 3))]), (0, -1, [(F32, (4, 3))]),
    (0, -1, [(F32, (2, 3))]),                                   # a smaller last batch
    (0, -1, [(F32, (4, 3)), (I64, (4,))]), (0, -1, [(F32, (4, 3)), (I64, (4,))]),
    (0, -1, [(F32, (4, 3)), (I64, (4,))]),
    (1, -1, [(torch.float64, (5,))]),                           # a tied parameter's gradient between
    (0, -1, [(F32, (4, 3)), (I64, (4,))]),
    (0, 0, [(F32, (4, 3))]), (0, 1, [(F32, (7,))]), (0, 0, [(F32, (4, 3))]), (0, 1, [(F32, (7,))]),  # two cuts
    (0, -1, [(torch.bfloat16, (3, 2, 2)), (torch.bool, (6,))]), (0, -1, [(torch.bfloat16, (3, 2, 2)), (torch.bool, (6,))]),
]


def _tensors(i: int, specs: list) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    out = []
    for dtype, shape in specs:
        if dtype == torch.bool:
            out.append(torch.rand(shape, generator=g) > 0.5)
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype))
        else:
            out.append(torch.randint(-1000, 1000, shape, generator=g, dtype=dtype))
    return out


def _exchange_job() -> list:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    transport = Transport(rank, [(0, 1), (1, 0)], "rank {}".format, torch.device("cpu"), timeout=30.0)
    got = []
    if rank == 0:
        for i, (channel, cut, specs) in enumerate(SEQUENCE):
            transport.send(1, Message(i, i % 3 or None, 10 + i, _tensors(i, specs), i % 2 == 0, channel, cut))
        back = transport.recv(1, 99, None, "the reply")
        got.append(back.tensors)
    else:
        for i, (channel, cut, _) in reversed(list(enumerate(SEQUENCE))):  # taken in any order: kept by key
            msg = transport.recv(0, i, i % 3 or None, f"message {i}", channel, cut)
            got.append((msg.mb, msg.micro, msg.version, msg.is_tuple, msg.channel, msg.cut, msg.tensors))
        transport.send(0, Message(99, None, 0, [torch.arange(6.0)], False))
    transport.close()
    dist.destroy_process_group()
    return got


@pytest.mark.multiprocess
def test_messages_arrive_whole_whatever_their_shapes_do():
    sent, received = spawn(_exchange_job, 2, ())
    assert len(received) == len(SEQUENCE)
    for (mb, micro, version, is_tuple, channel, cut, tensors) in received:
        want_channel, want_cut, specs = SEQUENCE[mb]
        assert (micro, version, is_tuple, channel, cut) == (mb % 3 or None, 10 + mb, mb % 2 == 0, want_channel,
                                                            want_cut)
        want = _tensors(mb, specs)
        assert [(t.dtype, tuple(t.shape)) for t in tensors] == [(t.dtype, tuple(t.shape)) for t in want]
        assert all(torch.equal(a, b) for a, b in zip(tensors, want)), mb
    assert torch.equal(sent[0][0], torch.arange(6.0))


def _silent_job() -> str:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    transport = Transport(rank, [(0, 1), (1, 0)], "rank {}".format, torch.device("cpu"), timeout=2.0)
    dist.barrier()
    if rank == 1:
        dist.barrier()  # waits for rank 0's timeout, sending nothing
        return "quiet"
    try:
        transport.recv(1, 0, None, "the activations")
    except PeerError as e:
        dist.barrier()
        return str(e)
    return "returned"


@pytest.mark.multiprocess
def test_a_silent_peer_is_named_after_the_timeout():
    message, quiet = spawn(_silent_job, 2, ())
    assert quiet == "quiet"
    assert message == "rank 1 went silent: nothing for 2s while rank 0 waited for the activations"
