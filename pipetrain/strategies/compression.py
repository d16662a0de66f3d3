"""Light gradient codecs applied inside the ring allreduce (Pipe-SGD §3.2, Li et al., NeurIPS'18).

Pipe-SGD compresses gradients *inside* Ring-AllReduce, so every transmit-and-reduce step decodes the
incoming block, adds the local block and encodes the sum again: 2(p-1) codec calls per allreduce.
The paper therefore picks codecs that are cheap and elementwise: truncation (drop the low mantissa
bits) and scalar quantization with a range set by the largest element. Those are ``trunc16`` and
``quant8`` here; ``none`` is the identity.

A codec turns a 1-D float block into a uint8 payload and back. Payloads are plain bytes, so the same
ring runs on gloo and NCCL whatever the codec packs into them. Every codec is deterministic: the same
block gives the same payload on every rank, which keeps the ranks' results bitwise identical.

[Note: no temporaries] A gradient may hold tens of millions of floats (vgg-like's: 27M) and a Pipe-SGD
worker encodes on one thread, so the codecs write through views and ``out=`` tensors and never
allocate a block-sized temporary: a fresh 50 MB tensor costs more in page faults than the arithmetic
on it.
"""
from __future__ import annotations

import sys

import torch

__all__ = ["CODECS", "QUANT_GROUP", "Codec", "get_codec"]

# One quant8 scale per QUANT_GROUP consecutive elements. One scale for a whole ring block (millions
# of elements) lets a single large gradient flatten every other value of the block to 0; a scale per
# 1024 elements bounds the error by |max| of a small neighbourhood (Pipe-SGD §3.2 takes the range
# from "the maximal element of a gradient vector"; we take it per group) and costs 4 bytes per
# 1024 (0.4 % on top of the 1 byte per element).
QUANT_GROUP = 1024

# Elements per pass of quant8's encoder: a chunk and its float32 scratch (2 MiB each) stay in cache.
_CHUNK = 1 << 19

# The int16 half of a float32 that holds its sign, exponent and top 7 mantissa bits.
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


class Codec:
    """Encodes a 1-D float block into a uint8 payload and decodes it back.

    Attributes:
        name: the registry name ("none", "trunc16", "quant8").
        granule: a block's element count must be a multiple of this.
        lossy: False only for the identity codec, whose payload is the block's own bytes; the ring
            relies on that to send lossless blocks without copying them.
    """

    name: str = ""
    granule: int = 1
    lossy: bool = True

    def payload_bytes(self, n: int, dtype: torch.dtype) -> int:
        """Bytes of the payload of an ``n``-element block of ``dtype``.

        Raises:
            ValueError: the codec does not take ``dtype``, or ``n`` is not a multiple of ``granule``.
        """
        raise NotImplementedError

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode the 1-D contiguous float block ``x``.

        Args:
            x: the block; its length must be a multiple of ``granule``.
            out: a uint8 tensor of ``payload_bytes(len(x), x.dtype)`` bytes to write into.

        Returns:
            The payload: ``out`` when given, else a new uint8 tensor (a view of ``x`` for ``none``).
        """
        raise NotImplementedError

    def decompress(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode ``payload`` into the float tensor ``out``, whose length and dtype say what to decode.

        Returns:
            ``out``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<codec {self.name}>"

    def _check(self, x: torch.Tensor, what: str) -> int:
        """Length of the 1-D block ``x``; raises ValueError when this codec cannot take it."""
        if x.dim() != 1 or not x.is_contiguous():
            raise ValueError(f"codec {self.name!r}: {what} must be a 1-D contiguous tensor, "
                             f"got shape {tuple(x.shape)}")
        self.payload_bytes(x.numel(), x.dtype)  # dtype and granule checks
        return x.numel()


def _float32_only(codec: Codec, n: int, dtype: torch.dtype) -> None:
    if dtype != torch.float32:
        raise ValueError(f"codec {codec.name!r} needs float32 gradients, got {dtype}")
    if n % codec.granule:
        raise ValueError(f"codec {codec.name!r} needs a block length that is a multiple of "
                         f"{codec.granule}, got {n}")


def _payload_out(out: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.shape != (nbytes,):
        raise ValueError(f"payload buffer must be uint8 of shape ({nbytes},), "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out


class Identity(Codec):
    """No compression: the payload is the block's own bytes, for any float dtype."""

    name, granule, lossy = "none", 1, False

    def payload_bytes(self, n: int, dtype: torch.dtype) -> int:
        if not dtype.is_floating_point:
            raise ValueError(f"codec 'none' needs a float dtype, got {dtype}")
        return n * dtype.itemsize

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        n = self._check(x, "the block")
        raw = x.view(torch.uint8)  # zero-copy
        if out is None:
            return raw
        return _payload_out(out, n * x.element_size(), x.device).copy_(raw)

    def decompress(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n = self._check(out, "out")
        _payload_out(payload, n * out.element_size(), out.device)
        out.view(torch.uint8).copy_(payload)
        return out


class Trunc16(Codec):
    """Keep the upper 16 bits of every float32: bfloat16 rounded toward zero (Pipe-SGD's truncation).

    It is not torch's bfloat16 cast, which rounds to nearest; truncation needs no arithmetic at all,
    only a strided copy. The bit pattern rules special values: inf, -0.0 and quiet NaNs survive; a NaN
    whose payload lies only in the low 16 mantissa bits becomes inf. 2 bytes per element.
    """

    name, granule, lossy = "trunc16", 1, True

    def payload_bytes(self, n: int, dtype: torch.dtype) -> int:
        _float32_only(self, n, dtype)
        return 2 * n

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        n = self._check(x, "the block")
        out = _payload_out(out, 2 * n, x.device)
        # the high int16 of each float32 (x.view(int32) >> 16), read in place by one strided copy
        out.view(torch.int16).copy_(x.view(torch.int16)[_HIGH_HALF::2])
        return out

    def decompress(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n = self._check(out, "out")
        _payload_out(payload, 2 * n, out.device)
        bits = out.view(torch.int32)
        bits.copy_(payload.view(torch.int16))  # sign-extends; the shift drops the extension
        bits.bitwise_left_shift_(16)
        return out


class Quant8(Codec):
    """8-bit scalar quantization with one scale per QUANT_GROUP elements (Pipe-SGD's quantization).

    Per group, scale = max|x| and q = round(x / scale * 127) in [-127, 127] (round half to even,
    deterministic); decoding gives q * (scale / 127), so |x - decoded| <= scale / 254 up to float
    rounding. An all-zero group has scale 0 and decodes to exact zeros. A group holding inf or NaN
    decodes to non-finite values, so a diverged gradient stays visible.

    Payload: the groups' float32 scales, then the int8 values: 4 * (n / QUANT_GROUP) + n bytes.
    """

    name, granule, lossy = "quant8", QUANT_GROUP, True

    def payload_bytes(self, n: int, dtype: torch.dtype) -> int:
        _float32_only(self, n, dtype)
        return 4 * (n // QUANT_GROUP) + n

    def compress(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        n = self._check(x, "the block")
        groups = n // QUANT_GROUP
        out = _payload_out(out, 4 * groups + n, x.device)
        scales = out[:4 * groups].view(torch.float32)
        values = out[4 * groups:].view(torch.int8).view(groups, QUANT_GROUP)
        xg = x.view(groups, QUANT_GROUP)
        # One pass over memory: each chunk of groups is read from DRAM once, then stays in cache
        # for its reductions, the scaling and the rounding.
        rows = max(1, _CHUNK // QUANT_GROUP)
        tmp = torch.empty(min(rows, groups), QUANT_GROUP, device=x.device)
        low = torch.empty(min(rows, groups), device=x.device)
        div = torch.empty(min(rows, groups), 1, device=x.device)
        for i in range(0, groups, rows):
            k = min(rows, groups - i)
            xc, scale, t, d = xg[i:i + k], scales[i:i + k], tmp[:k], div[:k]
            # max|x| as max(max x, -min x): two row reductions instead of an abs() pass
            torch.amax(xc, dim=1, out=scale)
            torch.maximum(scale, torch.amin(xc, dim=1, out=low[:k]).neg_(), out=scale)
            # x / scale * 127, not x * (127 / scale): 127 / scale is inf for scales below 4e-37.
            # An all-zero group divides by 1, not 0 (no 0/0 NaN).
            d.copy_(scale[:, None]).masked_fill_(d == 0, 1.0)
            torch.div(xc, d, out=t).mul_(127.0).round_()
            values[i:i + k].copy_(t)  # exact: t is an integer in [-127, 127]
        return out

    def decompress(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n = self._check(out, "out")
        groups = n // QUANT_GROUP
        _payload_out(payload, 4 * groups + n, out.device)
        scale = payload[:4 * groups].view(torch.float32)
        og = out.view(groups, QUANT_GROUP)
        og.copy_(payload[4 * groups:].view(torch.int8).view(groups, QUANT_GROUP))
        # a tensor divisor: CUDA divides by a Python number as a multiply by its reciprocal, which
        # rounds differently from the CPU's division
        og.mul_((scale / scale.new_full((), 127.0))[:, None])
        return out


CODECS: dict[str, Codec] = {c.name: c for c in (Identity(), Trunc16(), Quant8())}


def get_codec(name: str | None) -> Codec:
    """The codec registered as ``name``; None means no compression.

    Raises:
        ValueError: unknown name (the message lists the choices).
    """
    key = "none" if name is None else name
    if key not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(map(repr, CODECS))}")
    return CODECS[key]
