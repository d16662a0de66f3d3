"""Weights on disk by name, checked against files that safetensors, torch.save and transformers'
save_pretrained wrote themselves, and read back by safetensors and from_pretrained."""
from __future__ import annotations

import builtins
import io
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipetrain import weightfiles
from pipetrain.weightfiles import (INDEX, WeightFiles, WeightsError, join_shards, shard_name, write_index,
                                   write_shard)

transformers = pytest.importorskip("transformers")
TIED = {"lm_head.weight": ["model.embed_tokens.weight"]}


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama saved by save_pretrained in several shards, and its state dict."""
    model, directory = llama(), tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory, max_shard_size="20KB")
    return directory, {k: v.detach().clone() for k, v in model.state_dict().items()}


def weight_map(directory: Path) -> dict[str, str]:
    return json.loads((directory / INDEX).read_text())["weight_map"]


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, to compare tensors bitwise whatever their dtype (NaNs included)."""
    return t.reshape(-1).view(torch.uint8)


def header_bytes(path: Path) -> int:
    with builtins.open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


class CountingFile(io.BufferedReader):
    """A file that counts the bytes asked of it."""
    asked = 0

    def read(self, n: int | None = -1) -> bytes:
        data = super().read(n)
        self.asked += len(data)
        return data

    def readinto(self, buffer) -> int:
        n = super().readinto(buffer)
        self.asked += n
        return n


@pytest.fixture
def opened(monkeypatch) -> dict[Path, CountingFile]:
    """Every file weightfiles opens for reading, each counting the bytes read from it."""
    files: dict[Path, CountingFile] = {}

    def spy(path, mode="r", *args, **kwargs):
        if mode != "rb":
            return builtins.open(path, mode, *args, **kwargs)
        files[Path(path)] = CountingFile(io.FileIO(path, "rb"))
        return files[Path(path)]

    monkeypatch.setattr(weightfiles, "open", spy, raising=False)
    return files


def test_shards_give_names_shapes_and_dtypes_from_their_headers_only(saved, opened) -> None:
    directory, state = saved
    shards = weight_map(directory)
    assert len(set(shards.values())) >= 3 and "lm_head.weight" not in shards  # tied: HF writes it once
    files = WeightFiles.open(directory)
    assert sorted(files.keys) == sorted(shards)
    for key in shards:
        assert files.shape(key) == tuple(state[key].shape) and files.dtype(key) == state[key].dtype
        assert files.file_of(key) == directory / shards[key]
    assert {path: f.asked for path, f in opened.items()} == {
        directory / name: header_bytes(directory / name) for name in set(shards.values())}
    assert sorted(WeightFiles.open(directory / INDEX).keys) == sorted(shards)


def test_read_opens_only_the_shard_holding_the_keys_and_gives_tensors_the_caller_owns(saved, opened) -> None:
    directory, state = saved
    files = WeightFiles.open(directory)
    by_shard: dict[str, list[str]] = {}
    for key, name in weight_map(directory).items():
        by_shard.setdefault(name, []).append(key)
    name, keys = max(by_shard.items(), key=lambda item: len(item[1]))
    opened.clear()
    got = files.read(keys, device=torch.device("cpu"))
    assert list(opened) == [directory / name]
    assert list(got) == keys
    for key, t in got.items():
        assert torch.equal(t, state[key]) and t.is_contiguous() and t.device.type == "cpu"
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own memory, not a file's
        t.add_(1)
    again = files.read(keys)
    assert all(torch.equal(again[key], state[key]) for key in keys)


def test_check_reads_a_tied_head_from_the_embedding(saved) -> None:
    directory, state = saved
    files = WeightFiles.open(directory)
    expected = {key: (tuple(t.shape), t.dtype) for key, t in state.items()}
    sources = files.check(expected, TIED)
    assert sources == {key: "model.embed_tokens.weight" if key == "lm_head.weight" else key for key in state}
    got = files.read(set(sources.values()))
    assert all(torch.equal(got[sources[key]], t) for key, t in state.items())


def test_a_torch_saved_state_dict_is_read_by_name_without_touching_the_file(tmp_path) -> None:
    state = llama().state_dict()
    torch.save(state, tmp_path / "weights.pt")
    before = (tmp_path / "weights.pt").read_bytes()
    files = WeightFiles.open(tmp_path / "weights.pt")
    assert files.keys == list(state) and files.file_of("lm_head.weight") == tmp_path / "weights.pt"
    got = files.read(["lm_head.weight", "model.embed_tokens.weight"])
    assert all(torch.equal(t, state[key]) for key, t in got.items())
    got["lm_head.weight"].zero_()  # stored once with the embedding: the two reads must not share it
    assert torch.equal(got["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    assert (tmp_path / "weights.pt").read_bytes() == before


def test_every_safetensors_dtype_reads_and_writes_bitwise(tmp_path) -> None:
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.complex64,
              torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu]
    torch.manual_seed(0)
    tensors = {str(d): torch.randint(0, 256, (2, 8), dtype=torch.uint8).view(d) for d in dtypes}
    tensors["bool"] = torch.rand(2, 8) > 0.5
    tensors["scalar"], tensors["empty"] = torch.tensor(7, dtype=torch.int16), torch.empty(0, 4)
    save_file(tensors, tmp_path / "theirs.safetensors")
    files = WeightFiles.open(tmp_path / "theirs.safetensors")
    got = files.read(tensors)
    for key, t in tensors.items():
        assert files.dtype(key) == t.dtype and got[key].shape == t.shape
        assert torch.equal(raw(got[key]), raw(t))
    assert write_shard(tmp_path / "ours.safetensors", tensors) == sum(t.nbytes for t in tensors.values())
    back = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(raw(back[key]), raw(t)) for key, t in tensors.items())
    with safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    header = json.loads((tmp_path / "ours.safetensors").read_bytes()[8:header_bytes(tmp_path / "ours.safetensors")])
    starts = {key: spec["data_offsets"][0] for key, spec in header.items() if key != "__metadata__"}
    assert all(starts[key] % t.element_size() == 0 for key, t in tensors.items())  # each can be mapped in place


def test_write_shard_takes_views_strided_and_storage_sharing_tensors(tmp_path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {"base": base, "transposed": base.t(), "row": base[1], "column": base[:, 2], "same": base}
    write_shard(tmp_path / "shard.safetensors", tensors)
    back = load_file(tmp_path / "shard.safetensors")
    assert all(torch.equal(back[key], t) for key, t in tensors.items())
    assert [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]  # no temporary left beside it


def test_shards_and_index_written_per_stage_load_with_from_pretrained(saved, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory, state = saved
    keys = [key for key in state if key != "lm_head.weight"]  # tied: written once, as save_pretrained does
    stages = [keys[:3], keys[3:12], keys[12:]]
    assert shard_name(0, 3) == "model-00001-of-00003.safetensors"
    for part, stage in enumerate(stages):
        write_shard(tmp_path / shard_name(part, len(stages)), {key: state[key] for key in stage})
    write_index(tmp_path, {shard_name(part, len(stages)): stage for part, stage in enumerate(stages)})
    transformers.AutoConfig.from_pretrained(directory).save_pretrained(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    theirs = json.loads((directory / INDEX).read_text())
    assert index["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert list(index["weight_map"]) == sorted(keys)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[key], t) for key, t in state.items())


def test_joined_shards_are_one_model_safetensors_from_pretrained_loads(saved, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory, state = saved
    shards = sorted(directory / name for name in set(weight_map(directory).values()))
    monkeypatch.setattr(weightfiles, "CHUNK", 1000)  # several chunks per tensor
    join_shards(shards, tmp_path / "model.safetensors")
    joined = load_file(tmp_path / "model.safetensors")
    assert joined.keys() == state.keys() - {"lm_head.weight"}
    assert all(torch.equal(t, state[key]) for key, t in joined.items())
    transformers.AutoConfig.from_pretrained(directory).save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(loaded[key], t) for key, t in state.items())
    assert sorted(WeightFiles.open(tmp_path).keys) == sorted(joined)


def no_shard(saved, tmp_path: Path) -> Path:
    copy = Path(shutil.copytree(saved[0], tmp_path / "copy"))
    (copy / weight_map(copy)["model.norm.weight"]).unlink()
    return copy


def torch_file(value: object, tmp_path: Path) -> Path:
    torch.save(value, tmp_path / "weights.pt")
    return tmp_path / "weights.pt"


def damaged(tmp_path: Path) -> Path:
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 12) + b"{not json}  ")
    return tmp_path / "bad.safetensors"


def indexed(tmp_path: Path, listed: dict[str, list[str]]) -> None:
    """write_index over shards that each hold tensors 'a' and 'b', told they hold ``listed``."""
    for name in listed:
        write_shard(tmp_path / name, {"a": torch.ones(1), "b": torch.ones(2)})
    write_index(tmp_path, listed)


def expected(state: dict[str, torch.Tensor], **changes) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    shapes = {key: (tuple(t.shape), t.dtype) for key, t in state.items()}
    return {**shapes, **changes}


ERRORS = {  # name: (what raises it, given the saved model, its state and tmp_path; what its message names)
    "missing key": (lambda d, s, tmp: WeightFiles.open(d).check(expected(
        s, **{"model.extra.weight": ((2,), torch.float32), "model.more.bias": ((2,), torch.float32)}), TIED),
        ["'model.extra.weight'", "and 1 more", "{d}"]),
    "missing key and tie": (lambda d, s, tmp: WeightFiles.open(d).check(
        expected(s), {"lm_head.weight": ["model.wte.weight"]}), ["'lm_head.weight'", "nor its tie 'model.wte.weight'"]),
    "wrong shape": (lambda d, s, tmp: WeightFiles.open(d).check(expected(
        s, **{"model.norm.weight": ((16,), torch.float32)}), TIED),
        ["'model.norm.weight'", "(32,)", "(16,)", ".safetensors"]),
    "wrong dtype": (lambda d, s, tmp: WeightFiles.open(d).check(expected(s, **{
        "lm_head.weight": ((64, 32), torch.bfloat16)}), TIED),
        ["'model.embed_tokens.weight'", "'lm_head.weight'", "torch.bfloat16", "torch.float32", "model.to("]),
    "unknown key read": (lambda d, s, tmp: WeightFiles.open(d).read(["nope.weight"]), ["'nope.weight'", "{d}"]),
    "missing shard": (lambda d, s, tmp: WeightFiles.open(no_shard((d, s), tmp)), ["copy/" + INDEX, "is missing"]),
    "torch file not a dict": (lambda d, s, tmp: WeightFiles.open(torch_file([torch.ones(2)], tmp)),
                              ["weights.pt", "of type list"]),
    "torch file of non-tensors": (lambda d, s, tmp: WeightFiles.open(torch_file({"step": 3}, tmp)),
                                  ["weights.pt", "'step'"]),
    "not a torch file": (lambda d, s, tmp: WeightFiles.open(d / "config.json"), ["config.json", "torch.save"]),
    "damaged header": (lambda d, s, tmp: WeightFiles.open(damaged(tmp)), ["bad.safetensors", "not JSON"]),
    "no such path": (lambda d, s, tmp: WeightFiles.open(tmp / "nowhere"), ["nowhere", "no such file"]),
    "empty directory": (lambda d, s, tmp: WeightFiles.open(tmp), ["{tmp}", "model.safetensors"]),
    "duplicate key joined": (lambda d, s, tmp: join_shards([d / weight_map(d)["model.norm.weight"]] * 2,
                                                           tmp / "model.safetensors"),
                             ["cannot join", "{shard}"]),
    "index leaves a key out": (lambda d, s, tmp: indexed(tmp, {"s.safetensors": ["a"]}),
                               ["s.safetensors", "holds 'b'"]),
    "index names a key not there": (lambda d, s, tmp: indexed(tmp, {"s.safetensors": ["a", "b", "c"]}),
                                    ["s.safetensors", "lacks 'c'"]),
    "index has a key twice": (lambda d, s, tmp: indexed(tmp, dict.fromkeys(["s.safetensors", "t.safetensors"],
                                                                          ["a", "b"])),
                              ["'a'", "s.safetensors", "t.safetensors"]),
    "meta tensor written": (lambda d, s, tmp: write_shard(tmp / "s.safetensors", {"w": torch.empty(2, device="meta")}),
                            ["'w'", "meta device", "s.safetensors"]),
}


@pytest.mark.parametrize("case", ERRORS)
def test_each_error_is_one_line_naming_the_key_and_file(case, saved, tmp_path) -> None:
    make, names = ERRORS[case]
    directory, state = saved
    with pytest.raises(WeightsError) as caught:
        make(directory, state, tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    for name in names:
        assert name.format(d=directory, tmp=tmp_path, shard=weight_map(directory)["model.norm.weight"]) in message
