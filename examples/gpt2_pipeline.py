"""A Hugging Face GPT-2 (small, random init, tied embeddings) trained as a 3-stage PipeDream pipeline,
cut by submodule name, on dictionary items built ahead by background loaders.

    python examples/gpt2_pipeline.py            # 3 workers on this machine, stages begin at h.1 and h.3
    pipetrain train examples.gpt2_pipeline:model --data examples.gpt2_pipeline:text \\
        --loss examples.gpt2_pipeline:lm_loss --stages transformer.h.1,transformer.h.3 --batch-size 16 \\
        --loader-workers 2

torch.fx cannot trace GPT2LMHeadModel, so pipetrain captures it with torch.export on the first minibatch
(with the items' keyword inputs); its layers are the graph's operators, and ``stages`` names the
submodules later stages begin at. The word embedding and the output layer share one weight, as GPT-2's
do: the first and the last stage each hold a copy, kept identical. Items are dictionaries, as a
tokenizer gives them: ``labels`` is the target (``target_key``'s default), the other entries are the
model's keyword inputs. The model returns a ``CausalLMOutputWithCrossAttentions``; the loss takes its
``logits``. The text is the source of a module that ships with Python, read byte by byte (a 128-symbol
vocabulary).
"""
from __future__ import annotations

import functools
import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

import pipetrain

VOCAB, CONTEXT = 128, 32


def model(layers: int = 4, width: int = 64, dropout: float = 0.1, seed: int = 0, tied: bool = True) -> torch.nn.Module:
    """A GPT-2 language model at random init. Its word embedding and output layer are tied, as GPT-2's
    are: the first and the last stage each hold a copy, kept identical."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=width, n_layer=layers, n_head=4,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _windows(sequences: int, offset: int) -> torch.Tensor:
    """``sequences`` windows of CONTEXT + 1 bytes from Python's own ``textwrap`` source (ASCII)."""
    text = inspect.getsource(textwrap).encode("ascii", "replace")
    tokens = torch.tensor(list(text), dtype=torch.long).clamp_(max=VOCAB - 1)
    starts = (torch.arange(sequences) * 7 + offset) % (len(tokens) - CONTEXT - 1)
    return torch.stack([tokens[s:s + CONTEXT + 1] for s in starts.tolist()])


def data(sequences: int = 512, offset: int = 0) -> TensorDataset:
    """(tokens, next tokens) pairs of CONTEXT bytes."""
    windows = _windows(sequences, offset)
    return TensorDataset(windows[:, :-1], windows[:, 1:])


class Text(Dataset):
    """The same windows as dictionary items, as a tokenizer gives them: ``input_ids``,
    ``attention_mask`` (every position is text) and ``labels`` (the next tokens)."""

    def __init__(self, sequences: int = 512, offset: int = 0) -> None:
        self.windows = _windows(sequences, offset)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = self.windows[i]
        return {"input_ids": w[:-1], "attention_mask": torch.ones(CONTEXT, dtype=torch.long), "labels": w[1:]}


def text(sequences: int = 512, offset: int = 0) -> Text:
    """The dictionary items (what ``--data examples.gpt2_pipeline:text`` trains on)."""
    return Text(sequences, offset)


def lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a model output with ``logits`` (or the logits themselves)."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


if __name__ == "__main__":
    result = pipetrain.train(model(), text(), loss_fn=lm_loss, schedule="pipedream",
                             stages=["transformer.h.1", "transformer.h.3"], batch_size=16, epochs=2,
                             optimizer=functools.partial(torch.optim.Adam, lr=3e-3), loader_workers=2,
                             eval_dataset=text(64, offset=3), progress=True)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    tied = result.model.lm_head.weight is result.model.transformer.wte.weight
    print(f"GPT-2 on 3 stages: loss {first:.3f} -> {last:.3f} in {len(result.history)} updates, "
          f"{result.samples_per_s:.0f} samples/s, held-out loss {result.history[-1]['eval']['loss']:.3f}, "
          f"embedding and output layer {'still tied' if tied else 'UNTIED'}")
