"""Hugging Face models with their default configs (``use_cache`` on) split by name: captured without the
key/value cache, the user's config left as it was (skipped where transformers is not installed)."""
import copy
import functools

import pytest
import torch
from torch import nn

import pipetrain
from examples.gpt2_pipeline import data, lm_loss
from examples.llama_pipeline import model as llama
from pipetrain.layers import LayeredModel, LayerError

transformers = pytest.importorskip("transformers")
SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


def family(name: str) -> tuple[nn.Module, str]:
    """A small model of ``name``'s family, its config the library's default but for the sizes, and the
    submodule its second stage begins at."""
    torch.manual_seed(0)
    if name == "llama":
        return llama(layers=2, width=32), "model.layers.1"
    if name in ("mistral", "qwen2"):
        cls = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[name]
        return cls[1](cls[0](**SIZES, bos_token_id=0, eos_token_id=0)), "model.layers.1"
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config), "transformer.h.1"
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    return transformers.BertForMaskedLM(config), "bert.encoder.layer.1"


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gpt2", "bert"])
def test_a_default_config_splits_by_name_into_stages_that_compute_the_model(name: str, capsys) -> None:
    net, begins = family(name)
    net = net.double().eval()
    assert net.config.use_cache is True  # the library's default
    x = data(2)[:][0]
    layers = LayeredModel(net, x)
    head, tail = (stage.eval() for stage in layers.stages(layers.boundaries([begins])))  # default dropout off
    assert torch.allclose(tail(head(x)).logits, net(x).logits, rtol=0, atol=1e-12)
    LayeredModel(net, x[:1])  # captured again for other shapes: told once
    assert capsys.readouterr().out.count(f"pipetrain: captured {type(net).__name__} with config.use_cache=False") == 1
    assert net.config.use_cache is True


class ForcedCache(nn.Module):
    """Asks its Llama for the cache whatever the config says, so the capture cannot turn it off."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = llama(layers=1, width=32)

    def forward(self, x: torch.Tensor):
        return self.inner(x, use_cache=True)


def test_a_cache_the_capture_cannot_turn_off_is_named_with_what_to_set() -> None:
    with pytest.raises(LayerError, match=r"DynamicCache.*; pass the model with config.use_cache=False"):
        LayeredModel(ForcedCache(), data(2)[:][0])


@pytest.mark.multiprocess
def test_a_default_config_llama_in_two_stages_under_1f1b_flush_is_plain_sgd() -> None:
    net, dataset, lr, batch = llama(layers=2, width=32).double(), data(32), 0.05, 8
    result = pipetrain.train(net, dataset, loss_fn=lm_loss, optimizer=functools.partial(torch.optim.SGD, lr=lr),
                             stages=["model.layers.1"], schedule=pipetrain.OneFOneBFlush(microbatches=2),
                             batch_size=batch, shuffle=False, timeout=120)
    reference = copy.deepcopy(net)
    opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for t in range(len(dataset) // batch):
        x, y = dataset[t * batch:(t + 1) * batch]
        opt.zero_grad()
        lm_loss(reference(x), y).backward()
        opt.step()
    got, want = result.model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-9), key
    assert any(not torch.equal(p, q) for p, q in zip(net.state_dict().values(), want.values()))  # it did train
    assert net.config.use_cache is True
