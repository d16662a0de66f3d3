"""The model and its data: a Hugging Face Llama of a preset size, built on the meta device, and its
checkpoint written without ever holding the model whole."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from pipetrain.initialize import initial_values
from pipetrain.weightfiles import INDEX, shard_name, write_index, write_shard

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
"""What a size sets."""

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4),
    "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12),
    "1.5b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=28,
                 num_attention_heads=16),  # 1.57B parameters, 5.9 GiB
    "2.2b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=40,
                 num_attention_heads=16),  # 2.19B parameters, 8.2 GiB
    "2.7b": dict(vocab_size=32000, hidden_size=2560, intermediate_size=6912, num_hidden_layers=32,
                 num_attention_heads=20),
    "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32),  # Llama 2 7B's shape
}
"""Sizes by name; everything else is ``LlamaConfig``'s default (untied head, float32). Each has a
multiple of 4 decoder layers, so 4 stages hold equal counts."""


def config_of(size: str) -> LlamaConfig:
    return LlamaConfig(**SIZES[size], use_cache=False)


def meta_model(config: LlamaConfig) -> LlamaForCausalLM:
    """The model on the meta device: its structure, no memory."""
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def parameters(config: LlamaConfig) -> int:
    return sum(p.numel() for p in meta_model(config).parameters())


def write_checkpoint(directory: Path, config: LlamaConfig, seed: int = 0) -> bool:
    """Write the model's initial weights (what pipetrain's workers would initialize with ``seed``) to
    ``directory`` as ``save_pretrained`` would shard them, one shard per decoder layer plus one for the
    embedding and one for the final norm and head, each materialized alone and written before the next
    is made, so this process never holds more than one layer. An existing checkpoint of the same
    configuration is kept (the index is written last, so a half-written one is never taken for whole).

    Returns:
        Whether it wrote one (False: it was there).

    Raises:
        ValueError: ``directory`` holds a checkpoint of another configuration.
    """
    directory = Path(directory)
    if (directory / INDEX).exists():
        theirs = LlamaConfig.from_pretrained(directory)
        odd = [k for k in FIELDS if getattr(theirs, k) != getattr(config, k)]
        if odd:
            raise ValueError(f"{directory} holds a Llama with {odd[0]}={getattr(theirs, odd[0])}, not "
                             f"{getattr(config, odd[0])}; give another --checkpoint directory")
        return False
    model = meta_model(config)
    groups: list[list[str]] = [[] for _ in range(config.num_hidden_layers + 2)]
    for key in model.state_dict():
        groups[_shard_of(key, config.num_hidden_layers)].append(key)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    shards = {shard_name(g, len(groups)): keys for g, keys in enumerate(groups)}
    for name, keys in shards.items():
        write_shard(directory / name, initial_values(model, keys, seed))
    write_index(directory, shards)
    return True


def _shard_of(key: str, layers: int) -> int:
    """0 for the embedding, 1 + i for decoder layer i, the last for the final norm and the head."""
    if key.startswith("model.layers."):
        return 1 + int(key.split(".")[2])
    return 0 if key.startswith("model.embed_tokens.") else layers + 1


def stage_starts(config: LlamaConfig, stages: int = 4) -> list[str]:
    """The decoder layers stages 1.. begin at, giving each stage as many."""
    layers = config.num_hidden_layers
    return [f"model.layers.{layers * s // stages}" for s in range(1, stages)]


def job_data(config: LlamaConfig, updates: int, batch: int, seq: int, seed: int = 0) -> TensorDataset:
    """``updates`` minibatches of random token ids and their next tokens (a causal LM's inputs and
    targets), then the first minibatch again, the probe of [Note: the loss check] in ``bigmodel.ours``."""
    ids = torch.randint(config.vocab_size, (updates * batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([ids, ids[:batch]])
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (batch, seq, vocab) logits."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def trained_then_probe(steps: int) -> functools.partial[float]:
    """``LambdaLR``'s factor for ``steps`` SGD steps: 1 for all but the last, which runs at learning rate 0
    to measure the loss of the trained weights without changing them ([Note: the loss check])."""
    return functools.partial(_factor, last=steps - 1)


def _factor(step: int, last: int) -> float:
    return 0.0 if step >= last else 1.0


def output_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """:func:`lm_loss` of what ``LlamaForCausalLM`` returns (its ``logits``)."""
    return lm_loss(output.logits, target)
