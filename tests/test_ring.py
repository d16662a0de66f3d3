"""Codecs against independent references; the ring against the sequential recurrence, bitwise.

The ring's arithmetic is part of its spec (Pipe-SGD §3.2: the codec sits inside every
transmit-and-reduce step): block j is acc_0 = C(g_j of rank j), acc_k = C(D(acc_(k-1)) + g_j of rank
j+k), result D(acc_(p-1)). The parent recomputes that recurrence from the same seeds and compares
every rank's result with torch.equal.
"""
import datetime
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipetrain.runtime.launch import spawn
from pipetrain.strategies.compression import CODECS, QUANT_GROUP, get_codec
from pipetrain.strategies import ring as ring_module
from pipetrain.strategies.ring import allreduce, block_size, ring_allreduce

G = QUANT_GROUP
SIZES = [1, 7, 1001, 5 * G + 123]  # the last spans several quant8 groups and is not a multiple of G
CASES = [(c, n, torch.float32) for c in ("none", "trunc16", "quant8") for n in SIZES] + \
        [("none", n, torch.float64) for n in SIZES]


def _payload(codec: str, b: int, dtype: torch.dtype) -> int:
    """Payload bytes of a b-element block, from the format's description."""
    if codec == "none":
        return b * (8 if dtype == torch.float64 else 4)
    return {"trunc16": 2 * b, "quant8": b + 4 * (b // G)}[codec]


def _block(n: int, world: int, granule: int) -> int:
    b = -(-n // world)
    return max(granule, -(-b // granule) * granule)


def _grad(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s gradient: magnitudes spread over a few decades, some exact zeros."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= torch.randn(n, generator=g, dtype=torch.float64).exp()
    x[::11] = 0.0
    return x.to(dtype)


def _recurrence(grads: list[torch.Tensor], codec_name: str, b: int) -> torch.Tensor:
    """The ring's result from the padded flat gradients of the ring's ranks, in ring order."""
    codec, p, dtype = CODECS[codec_name], len(grads), grads[0].dtype
    out = torch.empty(p * b, dtype=dtype)
    for j in range(p):
        g = [grads[(j + k) % p][j * b:(j + 1) * b].clone() for k in range(p)]  # g[k]: ring rank j+k's
        acc = codec.compress(g[0])
        for k in range(1, p):
            acc = codec.compress(codec.decompress(acc, torch.empty(b, dtype=dtype)) + g[k]).clone()
        codec.decompress(acc, out[j * b:(j + 1) * b])
    return out


def _padded(seed: int, rank: int, n: int, dtype: torch.dtype, length: int) -> torch.Tensor:
    x = torch.zeros(length, dtype=dtype)
    x[:n] = _grad(seed, rank, n, dtype)
    return x


def _run(cases: list, seed: int, group) -> list:
    """Each case's (blocks, bytes sent) on this rank, from its second allreduce: both run in one
    workspace, so the second reuses the buffers the first left their bytes in."""
    p = dist.get_world_size(group)
    results = []
    for codec_name, n, dtype in cases:
        codec = get_codec(codec_name)
        b = block_size(n, p, codec.granule)
        held: dict[str, torch.Tensor] = {}
        for _ in range(2):
            blocks = _padded(seed, dist.get_rank(), n, dtype, p * b).view(p, b)
            sent = ring_allreduce(blocks, group, codec, held)
        assert (held or p == 1) and all(t.dtype == torch.uint8 for t in held.values())
        results.append((blocks, sent))
    return results


def _ring_job(cases: list, seed: int) -> dict:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    out = {"group": _run(cases[0::2], seed, group)}
    out["backend"] = [_lossless(n, dtype, seed, group) for codec_name, n, dtype in cases if codec_name == "none"]
    ring_module.CHUNK_BYTES = 100  # payloads of several messages, cut at odd byte offsets
    out["default"] = _run(cases[1::2], seed, None)
    if world == 3:
        # a subgroup whose indices are not the global ranks ([0, 2]: global 2 is index 1), and a
        # singleton group, which leaves the blocks alone
        pair, single = dist.new_group([0, 2]), dist.new_group([1])
        out["sub"] = _run(cases, seed, pair if rank != 1 else single)
    if world == 2:
        try:
            ring_allreduce(torch.zeros(3, 4), group, get_codec(None))
        except ValueError as e:
            out["bad_shape"] = str(e)
    return out


def _lossless(n: int, dtype: torch.dtype, seed: int, group) -> tuple[torch.Tensor, int]:
    """Pipe-SGD's allreduce without a codec (the backend's own): this rank's (blocks, bytes sent)."""
    p = dist.get_world_size(group)
    blocks = _padded(seed, dist.get_rank(), n, dtype, p * block_size(n, p, 1)).view(p, -1)
    return blocks, allreduce(blocks, group, get_codec(None))


def _check_lossless(results: list, cases: list, world: int, seed: int) -> None:
    """results[i][c]: rank i's (blocks, sent) of case c: the sum, bitwise the same on every rank."""
    for c, (_, n, dtype) in enumerate(cases):
        b = _block(n, world, 1)
        grads = torch.stack([_padded(seed, g, n, dtype, world * b) for g in range(world)]).double()
        for i in range(world):
            blocks, sent = results[i][c]
            assert torch.equal(blocks, results[0][c][0]) and sent == 2 * (world - 1) * _payload("none", b, dtype)
        got, exact = results[0][c][0].view(-1).double(), grads.sum(0)
        tol = 1e-12 if dtype == torch.float64 else 1e-6 * float(grads.abs().sum(0).max())
        torch.testing.assert_close(got, exact, rtol=0, atol=tol)


def _check(results: list, cases: list, ring: list[int], seed: int) -> None:
    """results[i][c]: ring position i's (blocks, sent) for case c."""
    p = len(ring)
    for c, (codec_name, n, dtype) in enumerate(cases):
        b = _block(n, p, CODECS[codec_name].granule)
        grads = [_padded(seed, g, n, dtype, p * b) for g in ring]
        want = _recurrence(grads, codec_name, b)
        for i in range(p):
            blocks, sent = results[i][c]
            where = f"{codec_name} n={n} {dtype} rank {ring[i]} of {ring}"
            assert blocks.shape == (p, b), where
            assert torch.equal(blocks.view(-1), want), where
            assert torch.equal(blocks, results[0][c][0]), where  # bitwise identical on every rank
            assert sent == 2 * (p - 1) * _payload(codec_name, b, dtype), where
        exact = torch.stack(grads).double().sum(0)
        got = results[0][c][0].view(-1).double()
        if dtype == torch.float64:
            torch.testing.assert_close(got, exact, rtol=0, atol=1e-12)
        else:  # a sum all the same: each of the p-1 re-encodings errs by under 1% of the magnitudes
            assert ((got - exact).abs() <= 0.01 * p * torch.stack(grads).abs().sum(0).max()).all(), where


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_the_sequential_recurrence(world):
    seed = 10 + world
    res = spawn(_ring_job, world, (CASES, seed))
    for key, cases in (("group", CASES[0::2]), ("default", CASES[1::2])):
        _check([r[key] for r in res], cases, list(range(world)), seed)
    _check_lossless([r["backend"] for r in res], [c for c in CASES if c[0] == "none"], world, seed)
    if world == 3:
        _check([res[0]["sub"], res[2]["sub"]], CASES, [0, 2], seed)
        for (blocks, sent), (codec_name, n, dtype) in zip(res[1]["sub"], CASES, strict=True):
            assert sent == 0
            assert torch.equal(blocks.view(-1)[:n], _grad(seed, 1, n, dtype)), (codec_name, n)
    if world == 2:
        assert [r["bad_shape"] for r in res] == \
            ["blocks must be a contiguous (2, b) tensor for a group of 2 ranks, got shape (3, 4)"] * 2


def _dead_peer_job() -> str:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    dist.barrier()
    if dist.get_rank() == 1:
        return "left"  # the worker exits: its sockets close under rank 0's receive
    try:
        ring_allreduce(torch.ones(2, G), None, get_codec("quant8"))
    except RuntimeError:  # DistBackendError is one
        return "raised"
    return "returned"


@pytest.mark.multiprocess
def test_a_dead_peer_raises_instead_of_hanging():
    t0 = time.monotonic()
    assert spawn(_dead_peer_job, 2, ()) == ["raised", "left"]
    assert time.monotonic() - t0 < 30


class _Counting:
    """A codec that counts the elements it encodes and decodes, and otherwise is ``inner``."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.granule, self.lossy = inner, inner.name, inner.granule, inner.lossy
        self.seen = {"encoded": 0, "decoded": 0}

    def payload_bytes(self, n, dtype):
        return self.inner.payload_bytes(n, dtype)

    def compress(self, x, out=None):
        self.seen["encoded"] += x.numel()
        return self.inner.compress(x, out=out)

    def decompress(self, payload, out):
        self.seen["decoded"] += out.numel()
        return self.inner.decompress(payload, out)


def _counted_ring_job(name: str, n: int) -> dict:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    codec = _Counting(get_codec(name))
    p = dist.get_world_size()
    b = block_size(n, p, codec.granule)
    ring_allreduce(_padded(3, dist.get_rank(), n, torch.float32, p * b).view(p, b), None, codec)
    return codec.seen


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["trunc16", "quant8"])
def test_what_the_codec_timing_runs_is_what_a_rank_of_the_ring_runs(name):
    # a rank encodes its own block and then each of the p-1 partial sums it passes on; it decodes each
    # of the p-1 partial sums it receives, the final block it made, and the p-1 final blocks the
    # all-gather brings: p encodes and 2p-1 decodes of a block, whatever the chunks
    n, p = 5 * G + 123, 3
    b = block_size(n, p, get_codec(name).granule)
    assert spawn(_counted_ring_job, p, (name, n)) == [{"encoded": p * b, "decoded": (2 * p - 1) * b}] * p
    codec = _Counting(get_codec(name))
    ring_module.ring_compute_seconds(codec, n, p, repeats=1)  # one warm-up and one timed run
    assert codec.seen == {"encoded": 2 * p * b, "decoded": 2 * (2 * p - 1) * b}


# ---- codecs ---------------------------------------------------------------------------------------

def _f32(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())


def test_trunc16_keeps_the_upper_16_bits():
    specials = [0x3F800000, 0xBF80C000,              # 1.0, -1.005859375
                0x00000001, 0x807FFFFF, 0x00800000,  # subnormals, the smallest normal
                0x00000000, 0x80000000,              # +0, -0
                0x7F800000, 0xFF800000,              # +inf, -inf
                0x7FC00000, 0xFFC12345,              # NaNs with high payload bits
                0x7F800001, 0x7F7FFFFF]              # a NaN whose payload is all low bits (-> inf), max
    rand = np.random.default_rng(0).integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([np.array(specials, dtype=np.uint32), rand])
    x = torch.from_numpy(bits.view(np.float32).copy())
    codec = get_codec("trunc16")
    payload = codec.compress(x)
    assert payload.dtype == torch.uint8 and payload.shape == (2 * len(bits),)
    assert np.array_equal(payload.numpy().view(np.uint16), (bits >> 16).astype(np.uint16))
    back = codec.decompress(payload, torch.empty(len(bits)))
    assert np.array_equal(back.numpy().view(np.uint32), bits & 0xFFFF0000)
    assert back[7].item() == float("inf") and back[11].item() == float("inf")  # 0x7F800001 -> inf
    assert str(back[6].item()) == "-0.0" and back[9].isnan() and back[10].isnan()


def test_trunc16_rounds_toward_zero_unlike_the_bfloat16_cast():
    x = _f32([0x3F80C000, 0xBF80C000])  # +-1.005859375: the low half is above the halfway point
    codec = get_codec("trunc16")
    got = codec.decompress(codec.compress(x), torch.empty(2))
    assert got.tolist() == [1.0, -1.0]
    assert x.to(torch.bfloat16).float().tolist() == [1.0078125, -1.0078125]


def test_payload_sizes_and_out_buffers():
    n = 3 * G
    for name, dtype, size in [("none", torch.float32, 4 * n), ("none", torch.float64, 8 * n),
                              ("trunc16", torch.float32, 2 * n), ("quant8", torch.float32, n + 12)]:
        codec = get_codec(name)
        x = torch.randn(n, dtype=dtype)
        assert codec.payload_bytes(n, dtype) == size
        assert codec.compress(x).shape == (size,)
        out = torch.empty(size, dtype=torch.uint8)
        assert codec.compress(x, out=out) is out
        assert torch.equal(codec.compress(x), out)


def test_identity_is_zero_copy_and_exact_in_float64():
    codec = get_codec(None)
    assert codec.name == "none" and not codec.lossy and codec is CODECS["none"]
    x = torch.randn(1001, dtype=torch.float64)
    payload = codec.compress(x)
    assert payload.data_ptr() == x.data_ptr()
    assert torch.equal(codec.decompress(payload.clone(), torch.empty_like(x)), x)
    assert CODECS["trunc16"].lossy and CODECS["quant8"].lossy and CODECS["quant8"].granule == G


def test_quant8_on_a_hand_written_vector():
    x = torch.zeros(4 * G)
    # group 0: scale 127, so q = round(x) with ties to even and decoding multiplies by 1.0
    g0 = [127.0, 62.5, -62.5, 63.5, 0.5, 1.5, -0.5, 2.4, -126.6]
    q0 = [127, 62, -62, 64, 0, 2, 0, 2, -127]
    # group 1: scale 2, q = round(x / 2 * 127); group 2: all zeros
    g1 = [2.0, -1.0, 0.5, -2.0, 0.03]
    q1 = [127, -64, 32, -127, 2]
    # group 3: scale 2^-124, so small that 127 / scale overflows float32
    tiny = 2.0 ** -124
    g3 = [tiny, -tiny / 2, tiny / 4]
    q3 = [127, -64, 32]
    x[:len(g0)] = torch.tensor(g0)
    x[G:G + len(g1)] = torch.tensor(g1)
    x[3 * G:3 * G + len(g3)] = torch.tensor(g3)
    codec = get_codec("quant8")
    payload = codec.compress(x)
    assert payload.shape == (16 + 4 * G,)
    assert payload[:16].view(torch.float32).tolist() == [127.0, 2.0, 0.0, tiny]
    q = payload[16:].view(torch.int8).view(4, G)
    for i, want in ((0, q0), (1, q1), (2, []), (3, q3)):
        assert q[i, :len(want)].tolist() == want and q[i, len(want):].eq(0).all()
    back = codec.decompress(payload, torch.full((4 * G,), 7.0)).view(4, G)
    assert back[0, :len(q0)].tolist() == [float(v) for v in q0]
    step = np.float32(2.0) / np.float32(127.0)
    assert back[1, :len(q1)].numpy().tolist() == (np.array(q1, dtype=np.float32) * step).tolist()
    assert torch.equal(back[2], torch.zeros(G))  # the all-zero group is exact, no NaN
    torch.testing.assert_close(back[3, :3], torch.tensor(g3), rtol=1e-2, atol=0)
    assert back[:, 9:].eq(0).all()


def test_quant8_error_is_at_most_half_a_step_per_group():
    gen = torch.Generator().manual_seed(3)
    groups = 16
    x = torch.randn(groups, G, generator=gen) * torch.logspace(-6, 4, groups)[:, None]
    x[5] = 0.0
    x[6] = -0.0
    codec = get_codec("quant8")
    back = codec.decompress(codec.compress(x.view(-1)), torch.empty(groups * G)).view(groups, G)
    xd = x.double()
    scale = xd.abs().amax(1, keepdim=True)
    err = (xd - back.double()).abs()
    # half a step, scale/254, plus float32 rounding of 127/scale and of q * (scale/127)
    assert (err <= scale / 254 * (1 + 1e-4)).all()
    nonzero = scale[:, 0] > 0
    assert (err.amax(1)[nonzero] >= 0.9 * scale[nonzero, 0] / 254).all()  # the bound is tight: 8 bits
    assert torch.equal(back[5:7], torch.zeros(2, G))


def test_quant8_keeps_a_non_finite_group_visible():
    x = torch.ones(2 * G)
    x[3] = float("inf")
    codec = get_codec("quant8")
    back = codec.decompress(codec.compress(x), torch.empty(2 * G))
    assert not back[:G].isfinite().any()
    assert torch.equal(back[G:], torch.ones(G))


@pytest.mark.parametrize("name", ["trunc16", "quant8"])
def test_lossy_codecs_need_float32(name):
    codec = get_codec(name)
    f64 = torch.zeros(G, dtype=torch.float64)
    msg = f"codec '{name}' needs float32 gradients, got torch.float64"
    for call in (lambda: codec.compress(f64),
                 lambda: codec.decompress(torch.zeros(4 * G, dtype=torch.uint8), f64),
                 lambda: codec.payload_bytes(G, torch.float64)):
        with pytest.raises(ValueError, match=msg) as e:
            call()
        assert "\n" not in str(e.value)


def test_quant8_needs_whole_groups():
    with pytest.raises(ValueError, match=f"multiple of {G}, got 1001"):
        get_codec("quant8").compress(torch.zeros(1001))


def test_get_codec_names_the_choices():
    assert get_codec(None) is get_codec("none")
    with pytest.raises(ValueError) as e:
        get_codec("zip")
    assert str(e.value) == "unknown codec 'zip'; choose one of 'none', 'trunc16', 'quant8'"


def test_block_size():
    assert [block_size(1, 4, 1), block_size(7, 3, 1), block_size(8, 4, 1)] == [1, 3, 2]
    assert block_size(0, 2, 1) == 1  # never an empty block
    assert [block_size(1001, 2, G), block_size(2 * G, 2, G), block_size(5 * G + 123, 2, G)] == [G, G, 3 * G]
