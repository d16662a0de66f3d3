"""Profiling a model built on the meta device, one layer at a time: the same layers and bytes as the same
model with real weights, never more than one layer's tensors held, and the bytes each layer's gradients
and optimizer state take."""
from __future__ import annotations

import functools
import json
import weakref

import pytest
import torch
from torch import nn

from pipetrain.batches import KeywordInputs
from pipetrain.profiling import Profile
from pipetrain.profiling import profile_model as profile
from pipetrain.profiling import profiler
from pipetrain.runtime.parts import is_meta
from pipetrain.setup import layer_step

ADAM = functools.partial(torch.optim.Adam, lr=0.1)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


class Residual(nn.Module):
    """A branchy model torch.fx traces: the cut inside the residual carries both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(self.b(torch.relu(self.a(h))) + h)


def sizes(measured: Profile) -> list[tuple[str, int, int, int | None, int]]:
    """What a profile says of each layer apart from its times."""
    return [(x.name, x.activation_bytes, x.parameter_bytes, x.trainable_bytes, x.optimizer_bytes)
            for x in measured.layers]


def on_meta(build):
    with torch.device("meta"):
        return build()


@pytest.mark.parametrize("build, batch", [(mlp, (torch.randn(32, 8), torch.randint(0, 4, (32,)))),
                                          (Residual, (torch.randn(5, 4), torch.randint(0, 3, (5,))))])
def test_a_meta_model_profiles_as_the_same_model_with_real_weights(build, batch):
    real = profile(build(), batch, nn.functional.cross_entropy, optimizer=ADAM, repeats=1, warmup=0)
    model = on_meta(build)
    meta = profile(model, batch, nn.functional.cross_entropy, optimizer=ADAM, repeats=1, warmup=0)
    assert sizes(meta) == sizes(real)
    assert (meta.batch_size, meta.device, meta.input_bytes, meta.ties) == (real.batch_size, "cpu", real.input_bytes, [])
    assert all(x.forward_s > 0 and x.backward_s > 0 for x in meta.layers)
    assert is_meta(model) and all(t.is_meta for t in model.state_dict().values())  # the caller's model untouched


def test_a_meta_llama_profiles_to_the_real_ones_bytes():
    """torch.export captures the meta model on the meta device, where attention's output has other
    strides than on the CPU, so its graph holds a ``contiguous`` more per block (bytes of a copy, no
    parameters); every other layer is the same, with the same bytes."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ids = torch.randint(0, 64, (4, 16))
    batch = (KeywordInputs(input_ids=ids), ids)

    def loss(out, target):
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    torch.manual_seed(0)
    real = profile(transformers.LlamaForCausalLM(config), batch, loss, optimizer=ADAM, repeats=1, warmup=0)
    meta = profile(on_meta(lambda: transformers.LlamaForCausalLM(config)), batch, loss, optimizer=ADAM, repeats=1,
                   warmup=0)
    extra = [x for x in meta.layers if ":contiguous" in x.name]
    assert len(extra) == 2 and all(x.parameter_bytes == 0 for x in extra)
    assert [x for x in sizes(meta) if ":contiguous" not in x[0]] == sizes(real)
    weights = sum(p.numel() * 4 for p in transformers.LlamaForCausalLM(config).parameters())
    assert meta.parameter_bytes == weights


def test_profiling_a_meta_model_holds_one_layers_stage_at_a_time(monkeypatch):
    """Each layer's stage is built when its turn comes and freed (by reference counting, at once) before
    the next is built: so the profiler never holds more than one layer's tensors (and what crosses the cut)."""
    built: list[weakref.ref] = []
    alive_at_build: list[int] = []
    build = profiler.layer_stage

    def tracked(*args, **kwargs):
        alive_at_build.append(sum(ref() is not None for ref in built))
        stage = build(*args, **kwargs)
        assert not any(t.is_meta for t in stage.state_dict().values())
        built.append(weakref.ref(stage))
        return stage

    monkeypatch.setattr(profiler, "layer_stage", tracked)
    model = on_meta(mlp)
    profile(model, (torch.randn(8, 8), torch.randint(0, 4, (8,))), nn.functional.cross_entropy, optimizer=ADAM,
            repeats=2, warmup=1)
    assert len(built) == len(model) and alive_at_build == [0] * len(model)
    assert all(ref() is None for ref in built)


def test_each_layer_records_its_trainable_bytes_and_its_optimizers_state():
    model = mlp()
    model[0].requires_grad_(False)  # a frozen layer: no gradient, no state
    momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    x = torch.randn(4, 8)
    by_sgd = profile(model, x, optimizer=momentum, repeats=1, warmup=1)
    by_adam = profile(model, x, optimizer=ADAM, repeats=1, warmup=1)
    weights = [(8 * 16 + 16) * 4, 0, (16 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4]
    assert [x.parameter_bytes for x in by_adam.layers] == weights
    assert [x.trainable_bytes for x in by_adam.layers] == [0, 0, weights[2], 0, weights[4]]
    assert [x.gradient_bytes for x in by_adam.layers] == [0, 0, weights[2], 0, weights[4]]
    assert [x.optimizer_bytes for x in by_sgd.layers] == [0, 0, weights[2], 0, weights[4]]  # one momentum buffer
    # Adam: two moments per parameter, and a step count (a float32 scalar on the CPU) per tensor
    assert [x.optimizer_bytes for x in by_adam.layers] == [0, 0, 2 * weights[2] + 2 * 4, 0, 2 * weights[4] + 2 * 4]
    assert profile(model, x, repeats=1, warmup=0).layers[2].optimizer_bytes == 0  # no optimizer, none measured


def test_a_profile_without_the_new_sizes_reads_with_their_defaults(tmp_path):
    measured = profile(mlp(), torch.randn(4, 8), optimizer=ADAM, repeats=1, warmup=0)
    measured.baseline_bytes = 123
    measured.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == measured
    old = json.loads((tmp_path / "p.json").read_text())
    del old["baseline_bytes"]
    for entry in old["layers"]:
        del entry["trainable_bytes"], entry["optimizer_bytes"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    again = Profile.load(tmp_path / "old.json")
    assert again.baseline_bytes == 0
    assert [(x.trainable_bytes, x.optimizer_bytes) for x in again.layers] == [(None, 0)] * 5
    assert [x.gradient_bytes for x in again.layers] == [x.parameter_bytes for x in measured.layers]  # all train


def test_a_layer_of_a_meta_model_stands_in_for_its_step():
    """The set-up's stand-in layer of a model built on the meta device is built alone, with real tensors,
    on real inputs (the layers before it run one at a time), and trains."""
    model = on_meta(mlp)
    kernel = layer_step(model, torch.randn(6, 8), [1.0, 0.5, 3.0, 3.0, 1.0], seconds=1.0)
    assert kernel is not None and not is_meta(kernel.stage) and not kernel.inputs.is_meta
    assert kernel.inputs.shape == (2, 16)  # 1 s of layer 2's 3 s: a third of the 6 rows
    kernel()
    assert all(p.grad is None for p in kernel.stage.parameters()) and is_meta(model)
