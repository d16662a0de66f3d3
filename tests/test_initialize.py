"""Initial weights of a model built on the meta device: the same values whatever the split into stages,
against references written here (torch's own reset_parameters under the documented seed, a CPU-built
Hugging Face model's rotary frequencies, the initializer's documented standard deviation)."""
import hashlib
import re

import pytest
import torch
from torch import nn

from pipetrain.initialize import InitError, assign, initial_values, materialize, meta_names

transformers = pytest.importorskip("transformers")


def seed_for(seed: int, path: str) -> int:
    """The documented derivation: the first 63 bits of sha256("seed:path")."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "big") >> 1


def llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def by_layers(names: list[str], groups: int) -> list[list[str]]:
    """Stages as a pipeline cuts them: layers 0.. in order, the embeddings with the first stage and the
    final norm, the head and the rotary embedding with the last."""
    layers = 4 // groups
    def stage(name: str) -> int:
        found = re.search(r"\.(?:layers|h)\.(\d+)\.", name)
        if found:
            return int(found.group(1)) // layers
        return 0 if re.search(r"embed_tokens|wte|wpe", name) else groups - 1
    return [[n for n in names if stage(n) == s] for s in range(groups)]


def dealt(names: list[str], groups: int) -> list[list[str]]:
    """Names dealt round-robin, so one module's tensors land in different calls."""
    return [names[s::groups] for s in range(groups)]


@pytest.mark.parametrize("build", [llama, gpt2])
@pytest.mark.parametrize("split", [(by_layers, 1), (by_layers, 2), (by_layers, 4), (dealt, 3)])
def test_any_split_gives_the_whole_models_values(build, split):
    whole = state(materialize(build(), seed=7))
    assert whole and not any(t.is_meta or (t.is_floating_point() and t.isnan().any()) for t in whole.values())
    cut, groups = split
    rng = torch.get_rng_state()
    got: dict[str, torch.Tensor] = {}
    for names in cut(meta_names(build()), groups):
        model = build()
        before = state(model)
        got.update(initial_values(model, names, seed=7))
        assert state(model) == before and all(t.is_meta for t in before.values())  # the caller's model untouched
    assert torch.equal(torch.get_rng_state(), rng)
    assert got.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(got[name], value), name
    other = state(materialize(build(), seed=8))
    assert not torch.equal(other["lm_head.weight"], whole["lm_head.weight"])


def test_torch_layers_get_reset_parameters_under_their_paths_seed():
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, dtype=torch.float64))
    with torch.device("meta"):
        model = build()
    materialize(model, seed=3)
    reference = build()
    for i, layer in enumerate(reference):
        torch.manual_seed(seed_for(3, str(i)))
        layer.reset_parameters()
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert not torch.equal(model[0].weight[:3, :3], model[2].weight[:3, :3].float())


def test_an_enclosing_module_has_the_last_word():
    """MultiheadAttention zeroes its out_proj's bias after out_proj's own reset, as when built on the CPU."""
    with torch.device("meta"):
        model = nn.Sequential(nn.MultiheadAttention(8, 2), nn.BatchNorm1d(8))
    materialize(model, seed=1)
    attention = nn.MultiheadAttention(8, 2)
    torch.manual_seed(seed_for(1, "0"))
    attention._reset_parameters()
    torch.manual_seed(seed_for(1, "0.out_proj"))
    attention.out_proj.reset_parameters()
    assert torch.equal(model[0].in_proj_weight, attention.in_proj_weight)
    assert torch.equal(model[0].in_proj_bias, attention.in_proj_bias)
    assert torch.equal(model[0].out_proj.weight, attention.out_proj.weight)
    assert torch.equal(model[0].out_proj.bias, torch.zeros(8))
    norm = model[1]
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.running_var, torch.ones(8))
    assert not norm.running_mean.any() and norm.num_batches_tracked.item() == 0


def test_llama_rotary_buffers_ties_and_requires_grad():
    model = llama()
    model.model.norm.weight.requires_grad_(False)
    with torch.device("meta"):  # the values are made on the CPU whatever the default device
        materialize(model)
    on_cpu = transformers.LlamaForCausalLM(model.config)
    for name in ("inv_freq", "original_inv_freq"):
        got = getattr(model.model.rotary_emb, name)
        assert got.device.type == "cpu" and (got > 0).all()
        assert torch.equal(got, getattr(on_cpu.model.rotary_emb, name))
    assert "model.rotary_emb.inv_freq" not in model.state_dict()  # still non-persistent
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.lm_head.weight, nn.Parameter)
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["model.norm.weight"]
    assert meta_names(model) == []


def test_hugging_face_initializer_distributions():
    llama_model, gpt2_model = materialize(llama()), materialize(gpt2())
    std = llama_model.config.initializer_range
    assert llama_model.model.layers[0].mlp.gate_proj.weight.std().item() == pytest.approx(std, rel=0.1)
    assert torch.equal(llama_model.model.layers[0].input_layernorm.weight, torch.ones(32))
    block = gpt2_model.transformer.h[1]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(std, rel=0.1)
    # GPT-2 scales its residual projections by the depth in the attention's and MLP's own initializer
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(std / (2 * 4) ** 0.5, rel=0.1)
    assert torch.equal(block.attn.c_proj.bias, torch.zeros(32))


class MyScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


class Block(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.linear, self.scale = nn.Linear(4, 4), inner


class Blocks(nn.Module):
    def __init__(self, inner: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(nn.LayerNorm(4)), Block(inner())])


class LinearsOnly(Blocks):
    """A model with its own initializer that knows Linear and nothing else."""

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.5)
            nn.init.zeros_(module.bias)


@pytest.mark.parametrize("model, says", [
    (lambda: Blocks(MyScale), ["'blocks.1.scale' (MyScale)", "'blocks.1.scale.weight' only in its __init__",
                               "give MyScale a reset_parameters()"]),
    (lambda: Blocks(Counter), ["'blocks.1.scale' (Counter)", "'blocks.1.scale.count' only in its __init__"]),
    (lambda: LinearsOnly(MyScale), ["'blocks.1.scale' (MyScale): LinearsOnly._init_weights leaves its tensor "
                                    "'blocks.1.scale.weight' unset"]),
])
def test_a_module_no_rule_initializes_is_named_in_one_line(model, says):
    with torch.device("meta"):
        meta = model()
    with pytest.raises(InitError) as raised:
        materialize(meta)
    message = str(raised.value)
    assert "\n" not in message and "weights=" in message
    for words in says:
        assert words in message
    assert meta_names(meta) == meta_names(model().to("meta"))  # nothing half-done
    # a worker whose stage lacks that module initializes the rest
    assert initial_values(meta, [n for n in meta_names(meta) if ".1.scale" not in n]).keys()


def test_rule_two_fills_what_rule_one_leaves():
    with torch.device("meta"):
        model = LinearsOnly(MyScale)
    model.blocks[1].scale = nn.Linear(4, 4)
    values = initial_values(model, ["blocks.0.scale.weight", "blocks.0.linear.weight", "blocks.0.linear.bias"])
    assert torch.equal(values["blocks.0.scale.weight"], torch.ones(4))  # LayerNorm's reset_parameters
    assert values["blocks.0.linear.weight"].std().item() > 0.2 and not values["blocks.0.linear.bias"].any()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(6, 4), nn.Linear(4, 6)
        self.head.weight = self.emb.weight
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_assign_keeps_ties_grads_and_persistence():
    model = Tied()
    model.emb.weight.requires_grad_(False)
    new = torch.randn(6, 4)
    assign(model, {"head.weight": new, "scratch": torch.ones(3)})
    assert model.emb.weight is model.head.weight and torch.equal(model.emb.weight, new)
    assert isinstance(model.emb.weight, nn.Parameter) and not model.emb.weight.requires_grad
    assert torch.equal(model.scratch, torch.ones(3)) and "scratch" not in model.state_dict()
    for values, says in [({"head.weight": torch.randn(4, 6)}, "'head.weight' is torch.float32 (6, 4)"),
                         ({"head.weight": torch.randn(6, 4, dtype=torch.float64)}, "the value given is torch.float64"),
                         ({"tail.weight": new}, "no parameter or buffer named 'tail.weight'")]:
        with pytest.raises(ValueError, match=re.escape(says)) as raised:
            assign(model, values)
        assert "\n" not in str(raised.value)


def test_real_tensors_pass_through():
    model = Tied()
    assert materialize(model) is model and model.head.weight is model.emb.weight
    values = initial_values(model, ["emb.weight", "head.weight", "head.bias"])
    assert values["emb.weight"] is values["head.weight"] and values["emb.weight"] is not model.emb.weight
    assert torch.equal(values["head.bias"], model.head.bias)
