"""Model weights on disk, by parameter name: read a stage's tensors from a safetensors file, a
``save_pretrained`` directory (one file or sharded) or a ``torch.save``'d state dict, opening only the
files that hold them; write a stage's tensors as Hugging Face shards and index, or join shards in one file.

The safetensors format (8-byte little-endian header length, a JSON header of dtype, shape and byte
range per tensor, then the data) is read and written here directly rather than through
``safetensors.torch``: its ``save_file`` needs every tensor on the CPU and contiguous at once and
refuses tensors that share storage, and reading a byte range into a tensor we allocate gives the caller
memory of its own, not a view of a mapped file.
"""
from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetrain.errors import first_line

__all__ = ["INDEX", "SINGLE", "WeightFiles", "WeightsError", "join_shards", "shard_name", "write_index",
           "write_shard"]

INDEX = "model.safetensors.index.json"
"""The index of a sharded ``save_pretrained`` directory: each tensor's name to its shard file."""

SINGLE = "model.safetensors"
"""The one weights file of an unsharded ``save_pretrained`` directory."""

CHUNK = 64 << 20
"""Bytes copied at a time, so joining or reading a large tensor never holds a second whole copy of it."""

MAX_HEADER = 100 << 20
"""The largest header safetensors itself accepts; a longer length field means a damaged file."""

GIVE = "give a .safetensors file, a directory save_pretrained wrote, or torch.save(model.state_dict(), path)"
"""What every error about an unreadable path tells the user to hand in instead."""

_DTYPES: dict[str, torch.dtype] = {
    name: dtype for name, dtype in {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U64": getattr(torch, "uint64", None), "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None), "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
        # float8 kinds exist only in newer torch builds; a file holding one this torch lacks is refused
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
        "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items() if dtype is not None}
"""safetensors' dtype names to torch's. F4 is left out: its header counts 4-bit elements, where torch
packs two in one ``float4_e2m1fn_x2``."""

_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class WeightsError(ValueError):
    """A weights file or directory that cannot give the tensors asked for; the message is one line."""


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lies: ``begin`` and ``end`` are absolute byte offsets in ``file`` (both 0 for a
    tensor of a ``torch.save``'d file, which torch locates itself)."""
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int = 0
    end: int = 0


def _damaged(path: Path, why: str) -> WeightsError:
    return WeightsError(f"weights {path}: not a readable safetensors file ({why}); write it again with "
                        f"save_pretrained or safetensors, or {GIVE}")


def _header(path: Path) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Each tensor's place in the safetensors file ``path`` and the file's metadata, from its header
    alone; every byte range is checked against the file's size, so reading it later cannot run short.

    Raises:
        WeightsError: the file is missing, cut short or its header is not a safetensors header.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise _damaged(path, f"{size} bytes, shorter than the header's length")
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, MAX_HEADER):
                raise _damaged(path, f"header length {length} past the end of its {size} bytes")
            header = json.loads(f.read(length).decode("utf-8"))
    except OSError as e:
        raise WeightsError(f"weights {path}: cannot read it ({e.strerror or e}); {GIVE}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(path, f"header is not JSON: {first_line(e, 80)}") from None
    if not isinstance(header, dict):
        raise _damaged(path, "header is not a JSON object")
    start = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _damaged(path, "its __metadata__ is not a JSON object")
    entries = {}
    for key, spec in header.items():
        name = spec.get("dtype") if isinstance(spec, dict) else None
        if isinstance(name, str) and name not in _DTYPES:
            raise _damaged(path, f"tensor {key!r} has dtype {name!r}, which pipetrain cannot read into torch")
        try:
            dtype = _DTYPES[spec["dtype"]]
            shape = tuple(int(n) for n in spec["shape"])
            begin, end = (int(n) for n in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _damaged(path, f"tensor {key!r} lacks a dtype, shape or data_offsets") from None
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= size - start \
                or end - begin != math.prod(shape) * dtype.itemsize:
            raise _damaged(path, f"tensor {key!r}'s bytes {begin}..{end} do not fit its shape {shape} "
                                 f"or the file's {size} bytes")
        entries[key] = _Entry(path, shape, dtype, start + begin, start + end)
    return entries, metadata


def _read_exact(f: io.BufferedReader, at: int, into: memoryview, path: Path) -> None:
    """Fill ``into`` from byte ``at`` of ``f`` (one read may return less than asked for, past 2 GiB)."""
    f.seek(at)
    done = 0
    while done < len(into):
        got = f.readinto(into[done:])
        if not got:
            raise WeightsError(f"weights {path}: the file ends early (was it changed or cut short while in "
                               f"use?); write it again")
        done += got


def _bytes(t: torch.Tensor) -> memoryview:
    """``t``'s bytes in row-major order, on the CPU: one copy when ``t`` is elsewhere or strided, else
    ``t``'s own memory (so reading into them fills ``t``)."""
    t = t.detach().to("cpu", memory_format=torch.contiguous_format).contiguous()
    return t.view(-1).view(torch.uint8).numpy().data


class WeightFiles:
    """Tensors by name in one or more weights files: shapes and dtypes come from headers when opened,
    and a tensor's data is read only when asked for, from the one file that holds it.

    Attributes:
        path: the file or directory it was opened at, as error messages name it.
    """

    def __init__(self, path: Path, entries: dict[str, _Entry], mapped: Mapping[str, torch.Tensor]) -> None:
        self.path = path
        self._entries = entries
        self._mapped = mapped  # a torch.save'd file's tensors, mapped from disk by torch.load(mmap=True)

    @classmethod
    def open(cls, path: str | os.PathLike) -> WeightFiles:
        """The weights at ``path``: a ``.safetensors`` file, a ``save_pretrained`` directory (sharded
        with ``model.safetensors.index.json``, or one ``model.safetensors``), that index file itself,
        or a ``torch.save``'d state dict (any other file, mapped: nothing is read until asked for).

        Raises:
            WeightsError: the path is missing or is none of these, a shard of an index is missing, or
                a file is damaged.
        """
        path = Path(path)
        if path.is_dir():
            if (path / INDEX).is_file():
                return cls._sharded(path, path / INDEX)
            if (path / SINGLE).is_file():
                return cls(path, _header(path / SINGLE)[0], {})
            raise WeightsError(f"weights {path} is a directory with neither {INDEX} nor {SINGLE}; "
                               f"{GIVE}")
        if not path.exists():
            raise WeightsError(f"weights {path}: no such file or directory; {GIVE}")
        if path.name.endswith(".index.json"):
            return cls._sharded(path, path)
        if path.suffix == ".safetensors":
            return cls(path, _header(path)[0], {})
        return cls._torch(path)

    @classmethod
    def _sharded(cls, path: Path, index: Path) -> WeightFiles:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = {name: index.parent / name for name in set(weight_map.values())}
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"weights {index}: not an index save_pretrained wrote (no weight_map of "
                               f"tensor names to shard files: {first_line(e, 80)}); {GIVE}") from None
        for name, shard in sorted(shards.items()):
            if not shard.is_file():
                key = next(k for k, v in weight_map.items() if v == name)
                raise WeightsError(f"weights {index} names shard {name!r} (for {key!r} and others) but "
                                   f"{shard} is missing; copy every shard save_pretrained wrote beside it")
        headers = {name: _header(shard)[0] for name, shard in shards.items()}
        entries = {}
        for key, name in weight_map.items():
            if key not in headers[name]:
                raise WeightsError(f"weights {index} places {key!r} in {shards[name]}, which does not hold "
                                   f"it; write the directory again with save_pretrained")
            entries[key] = headers[name][key]
        return cls(path, entries, {})

    @classmethod
    def _torch(cls, path: Path) -> WeightFiles:
        try:
            state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # torch raises many kinds for a file that is not its own; each is the file's fault
            raise WeightsError(f"weights {path}: not a state dict torch.save wrote ({first_line(e, 120)}); "
                               f"{GIVE}") from None
        bad = (f"it is of type {type(state).__name__}" if not isinstance(state, dict) else
               next((f"{k!r} is of type {type(v).__name__}" for k, v in state.items()
                     if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None))
        if bad is not None:
            raise WeightsError(f"weights {path}: not a dict of tensor names to tensors ({bad}); {GIVE}")
        return cls(path, {k: _Entry(path, tuple(v.shape), v.dtype) for k, v in state.items()}, state)

    @property
    def keys(self) -> list[str]:
        """Every tensor name the weights hold, in the files' order."""
        return list(self._entries)

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise WeightsError(f"weights {self.path} has no tensor {key!r}; ask only for names in its "
                               f"keys (WeightFiles.check finds each one's source)") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key).dtype

    def file_of(self, key: str) -> Path:
        """The file holding ``key``: for a sharded directory, its shard."""
        return self._entry(key).file

    def read(self, keys: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The tensors named ``keys``, each a new contiguous tensor on ``device`` that the caller owns
        (no view of a mapped file); only the files holding them are opened.

        Raises:
            WeightsError: a key the weights lack, or a file that changed since it was opened.
        """
        wanted = {key: self._entry(key) for key in keys}
        out: dict[str, torch.Tensor] = {}
        with ExitStack() as files:
            handles: dict[Path, io.BufferedReader] = {}
            for key, e in wanted.items():
                t = torch.empty(e.shape, dtype=e.dtype)
                if key in self._mapped:
                    t.copy_(self._mapped[key])
                elif e.end > e.begin:
                    if e.file not in handles:
                        handles[e.file] = files.enter_context(open(e.file, "rb"))
                    _read_exact(handles[e.file], e.begin, _bytes(t), e.file)
                out[key] = t.to(device)
        return out

    def check(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
              aliases: Mapping[str, Sequence[str]] = {}) -> dict[str, str]:
        """Where each tensor a worker needs comes from, after checking it fits.

        Args:
            expected: each needed tensor's name to the (shape, dtype) the model gives it.
            aliases: a name to the other names of the same tied parameter, for the files that hold a
                tied parameter once (Hugging Face omits ``lm_head.weight`` tied to the embedding).

        Returns:
            Each expected name to the key to read it from: itself, or its first alias the files hold.

        Raises:
            WeightsError: a name the files lack under it and every alias, or a tensor whose shape or
                dtype differs from the model's.
        """
        sources: dict[str, str] = {}
        missing: list[str] = []
        for name in expected:
            found = next((k for k in (name, *aliases.get(name, ())) if k in self._entries), None)
            if found is None:
                missing.append(name)
            else:
                sources[name] = found
        if missing:
            ties = aliases.get(missing[0], ())
            tie = f" (nor its tie {', '.join(map(repr, ties))})" if ties else ""
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise WeightsError(f"weights {self.path} has no tensor {missing[0]!r}{tie}{more}; give the weights "
                               f"of this model, as its save_pretrained or torch.save(model.state_dict()) wrote them")
        for name, (shape, dtype) in expected.items():
            key = sources[name]
            e = self._entries[key]
            what = f"tensor {key!r}" + (f" (read for its tie {name!r})" if key != name else "")
            if e.shape != tuple(shape):
                raise WeightsError(f"weights {e.file}: {what} has shape {e.shape} but the model's is "
                                   f"{tuple(shape)}; give the weights of a model with this configuration")
            if e.dtype != dtype:
                raise WeightsError(f"weights {e.file}: {what} is {e.dtype} but the model's is {dtype}; build "
                                   f"the model in the file's dtype (model.to({e.dtype}) before training) "
                                   f"or convert the file to {dtype}")
        return sources


def shard_name(part: int, parts: int) -> str:
    """Hugging Face's name for shard ``part`` (from 0) of ``parts``: ``model-00001-of-00004.safetensors``."""
    return f"model-{part + 1:05d}-of-{parts:05d}.safetensors"


@contextmanager
def _atomic(target: Path, durable: bool = True) -> Iterator[io.BufferedWriter]:
    """A file that becomes ``target`` only once fully written (and, ``durable``, on disk), so a reader
    (or a job restarted after a crash) never finds half a file under the final name."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _head(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...], int]], metadata: Mapping[str, str]
          ) -> tuple[bytes, list[str]]:
    """The length field and header of a safetensors file holding ``specs`` (name to dtype, shape and
    bytes), and the order their data must follow: widest dtype first, as safetensors lays it out, so
    every tensor starts at a multiple of its element size and can be mapped in place."""
    order = sorted(specs, key=lambda k: (-specs[k][0].itemsize, k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key in order:
        dtype, shape, nbytes = specs[key]
        if dtype not in _NAMES:
            raise WeightsError(f"cannot write tensor {key!r}: safetensors has no {dtype}; convert it first")
        header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, order


def write_shard(path: Path, tensors: Mapping[str, torch.Tensor], durable: bool = True) -> int:
    """Write ``tensors`` as one safetensors file with the ``{"format": "pt"}`` metadata transformers
    expects, atomically (and, ``durable``, synced to disk: a file that is to outlive the job). Each
    tensor is copied to the CPU (and made contiguous) only while it is written, so a stage on a GPU
    never needs a second copy of all its weights in host memory; tensors sharing storage are each
    written whole.

    Returns:
        The bytes of tensor data written.

    Raises:
        WeightsError: a tensor on the meta device (never given values) or of a dtype safetensors lacks.
    """
    meta = next((k for k, t in tensors.items() if t.is_meta), None)
    if meta is not None:
        raise WeightsError(f"cannot write tensor {meta!r} to {path}: it is on the meta device and has no "
                           f"values; load or initialize the model's weights first")
    head, order = _head({k: (t.dtype, tuple(t.shape), t.numel() * t.element_size())
                         for k, t in tensors.items()}, {"format": "pt"})
    with _atomic(Path(path), durable) as f:
        f.write(head)
        for key in order:
            f.write(_bytes(tensors[key]))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_index(directory: Path, shards: Mapping[str, Iterable[str]]) -> None:
    """Write ``model.safetensors.index.json`` in ``directory`` as ``save_pretrained`` does: each key
    (sorted) to its shard and ``metadata.total_size``, the tensors' bytes from the shards' headers.

    Args:
        shards: each shard's file name in ``directory`` to the keys it holds.

    Raises:
        WeightsError: a shard missing or damaged, keys that are not exactly those its shard holds (a
            tensor left out of the index would be silently left out of the model), or a key in two shards.
    """
    directory = Path(directory)
    weight_map: dict[str, str] = {}
    total = 0
    for name, keys in shards.items():
        entries = _header(directory / name)[0]
        listed = set(keys)
        odd = sorted(listed.symmetric_difference(entries))
        if odd:
            how = "lacks" if odd[0] in listed else "holds"
            given = "name" if how == "lacks" else "leave out"
            raise WeightsError(f"cannot index {directory / name}: it {how} {odd[0]!r}, which the keys given for "
                               f"it {given}; give exactly the keys each shard holds")
        both = sorted(listed & weight_map.keys())
        if both:
            raise WeightsError(f"cannot index {both[0]!r} in both {weight_map[both[0]]} and {name}; "
                               f"write each tensor in one shard")
        weight_map.update(dict.fromkeys(listed, name))
        total += sum(e.end - e.begin for e in entries.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with _atomic(directory / INDEX) as f:
        f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())


def join_shards(shards: Sequence[Path], target: Path) -> None:
    """Write one safetensors file holding every tensor of ``shards``, atomically, copying the data
    ``CHUNK`` bytes at a time so no tensor is ever whole in memory; the shards' metadata is kept.

    Raises:
        WeightsError: a shard missing or damaged, or a key in two shards.
    """
    where: dict[str, _Entry] = {}
    metadata: dict[str, str] = {"format": "pt"}
    for shard in map(Path, shards):
        entries, meta = _header(shard)
        for key, e in entries.items():
            if key in where:
                raise WeightsError(f"cannot join {key!r}: both {where[key].file} and {shard} hold it; "
                                   f"join shards that each hold their own tensors")
            where[key] = e
        metadata.update(meta)
    head, order = _head({k: (e.dtype, e.shape, e.end - e.begin) for k, e in where.items()}, metadata)
    buffer = memoryview(bytearray(min(CHUNK, max((e.end - e.begin for e in where.values()), default=0))))
    with ExitStack() as files, _atomic(Path(target)) as out:
        sources = {shard: files.enter_context(open(shard, "rb")) for shard in {e.file for e in where.values()}}
        out.write(head)
        for key in order:
            e = where[key]
            for at in range(e.begin, e.end, CHUNK):
                part = buffer[:min(CHUNK, e.end - at)]
                _read_exact(sources[e.file], at, part, e.file)
                out.write(part)
