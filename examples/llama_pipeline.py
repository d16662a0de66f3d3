"""A Hugging Face Llama (small, random init, its default config but for the sizes) trained as a 2-stage
1F1B pipeline with a flush, cut by submodule name.

    python examples/llama_pipeline.py            # 2 workers on this machine, the second stage begins at layers.2
    pipetrain train examples.llama_pipeline:model --data examples.llama_pipeline:data \\
        --loss examples.llama_pipeline:lm_loss --stages model.layers.2 --schedule 1f1b-flush --microbatches 2 \\
        --batch-size 16

The config keeps Llama's defaults: grouped-query attention (fewer key/value heads than query heads), rotary
position embeddings, RMSNorm, and ``use_cache=True``. torch.fx cannot trace the model, so pipetrain captures
it with torch.export on the first minibatch, with the key/value cache off for the capture (training reads
none; the model's config stays as it is). The text is the source of a module that ships with Python, read
byte by byte (:mod:`examples.gpt2_pipeline`'s windows).
"""
from __future__ import annotations

import functools

import torch

import pipetrain
from examples.gpt2_pipeline import CONTEXT, VOCAB, data, lm_loss

__all__ = ["data", "lm_loss", "model"]


def model(layers: int = 4, width: int = 64, seed: int = 0) -> torch.nn.Module:
    """A Llama language model at random init: 4 query heads share 2 key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


if __name__ == "__main__":
    result = pipetrain.train(model(), data(), loss_fn=lm_loss, stages=["model.layers.2"],
                             schedule=pipetrain.OneFOneBFlush(microbatches=2), batch_size=16, epochs=2,
                             optimizer=functools.partial(torch.optim.Adam, lr=3e-3), eval_dataset=data(64, offset=3),
                             progress=True)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    print(f"Llama on 2 stages: loss {first:.3f} -> {last:.3f} in {len(result.history)} updates, "
          f"{result.samples_per_s:.0f} samples/s, held-out loss {result.history[-1]['eval']['loss']:.3f}")
