"""Small models shaped like the papers', sized for CPUs; shared by the demo, tests and benchmarks.

Every model is an ``nn.Sequential`` (each child one layer) except ``resnet_like``, which ``torch.fx``
traces; either way :class:`pipetrain.layers.LayeredModel` can cut it into stages. Every model ends in
class logits for ``F.cross_entropy``; the language model's are ``(N, vocab, T)`` so that holds there too.

``SPECS`` names each model with what a benchmark needs around it: the input a sample has, the targets,
and a synthetic dataset of that shape. ``MODELS`` maps the same names to the factories alone.
"""
from __future__ import annotations

import codecs
import contextlib
import functools
import io
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def digits_cnn(width: int = 32) -> nn.Sequential:
    """A small CNN for 1x8x8 digit images: two conv blocks, then a fully connected head (10 classes)."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 16, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )


def vgg_like(in_channels: int = 3, image: int = 32, widths: tuple[int, ...] = (64, 128, 256, 512),
             hidden: int = 4096, classes: int = 10) -> nn.Sequential:
    """VGG's shape (arXiv:1409.1556): a conv stack, then fully connected layers holding most weights.

    One 3x3 conv + ReLU + 2x2 max-pool per entry of ``widths``, then Flatten and
    ``features -> hidden -> hidden -> classes`` with ``features = widths[-1] * (image / 2**len(widths))**2``.
    The defaults give 512x2x2 = 2,048 features and 2048-4096-4096-10 FC layers: 26.8M parameters
    (107 MB), 25.2M of them in the FC layers, while a sample crossing the cut before Flatten is 8 KB. This is
    the regime where PipeDream (arXiv:1806.03377) beats data parallelism: synchronising weights costs far
    more than sending activations.

    Shapes: input ``(N, in_channels, image, image)`` float, output ``(N, classes)``.

    Raises:
        ValueError: ``image`` is not divisible by ``2**len(widths)``.
    """
    side = image >> len(widths)
    if side < 1 or side << len(widths) != image:
        raise ValueError(f"vgg_like: image={image} must be divisible by 2**len(widths)={2 ** len(widths)}")
    layers: list[nn.Module] = []
    c = in_channels
    for w in widths:
        layers += [nn.Conv2d(c, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c = w
    features = c * side * side
    layers += [nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
               nn.Linear(hidden, classes)]
    return nn.Sequential(*layers)


def alexnet_like(in_channels: int = 3, image: int = 32, width: int = 64, hidden: int = 2048,
                 classes: int = 10) -> nn.Sequential:
    """AlexNet's shape (Krizhevsky et al. 2012) for small images: five convs, three FC layers.

    Channels ``width, 3*width, 6*width, 4*width, 4*width`` (64-192-384-256-256 by default) with 2x2
    max-pools after the first, second and fifth conv, then ``features -> hidden -> hidden -> classes``
    where ``features = 4*width * (image/8)**2`` (4,096 by default). No dropout: runs stay deterministic.

    Shapes: input ``(N, in_channels, image, image)`` float with ``image`` divisible by 8, output ``(N, classes)``.
    """
    if image % 8:
        raise ValueError(f"alexnet_like: image={image} must be divisible by 8")
    w = [width, 3 * width, 6 * width, 4 * width, 4 * width]
    return nn.Sequential(
        nn.Conv2d(in_channels, w[0], 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w[0], w[1], 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w[1], w[2], 3, padding=1), nn.ReLU(),
        nn.Conv2d(w[2], w[3], 3, padding=1), nn.ReLU(),
        nn.Conv2d(w[3], w[4], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(w[4] * (image // 8) ** 2, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes),
    )


class _Block(nn.Module):
    """A ResNet basic block (arXiv:1512.03385): two 3x3 convs and a shortcut, 1x1 where the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNetLike(nn.Module):
    """See :func:`resnet_like`. Not a Sequential: the residual adds make it a graph, which torch.fx traces."""

    def __init__(self, in_channels: int, width: int, blocks: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        body: list[nn.Module] = []
        c = width
        for i, n in enumerate(blocks):
            for j in range(n):
                c_out = width << i
                body.append(_Block(c, c_out, 2 if i > 0 and j == 0 else 1))
                c = c_out
        self.body = nn.Sequential(*body)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet_like(in_channels: int = 3, width: int = 16, blocks: tuple[int, ...] = (2, 2, 2),
                classes: int = 10) -> ResNetLike:
    """A CIFAR-style ResNet (arXiv:1512.03385 §4.2): 3x3 stem, stages of basic blocks, global pool, FC.

    Stage i has ``blocks[i]`` blocks of ``width * 2**i`` channels, halving the resolution on entry
    (except stage 0). The defaults are ResNet-14 for CIFAR (about 0.17M parameters). ``torch.fx``
    traceable, so a cut may fall inside a block; then both the residual and the branch cross it.

    Shapes: input ``(N, in_channels, H, W)`` float (any H, W >= 2**(len(blocks)-1)), output ``(N, classes)``.
    """
    return ResNetLike(in_channels, width, tuple(blocks), classes)


def mnist_mlp(in_features: int = 784, hidden: tuple[int, ...] = (500, 500), classes: int = 10) -> nn.Sequential:
    """Pipe-SGD's MNIST network (Li et al., NeurIPS 2018, §5): a 784-500-500-10 perceptron with ReLU.

    Shapes: input ``(N, in_features)`` or ``(N, 1, 28, 28)`` float (flattened first), output ``(N, classes)``.
    """
    layers: list[nn.Module] = [nn.Flatten()]
    d = in_features
    for h in hidden:
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    layers.append(nn.Linear(d, classes))
    return nn.Sequential(*layers)


class LSTMLayer(nn.Module):
    """One ``nn.LSTM`` layer that returns only its output sequence, so it can be a Sequential child.

    ``nn.LSTM`` returns ``(output, (h, c))``; a pipeline cut must carry tensors only, and the next layer
    wants the sequence. Each layer starts from zero state on every minibatch (no truncated BPTT carry-over).
    """

    def __init__(self, d_in: int, d_hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, d_hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, d_in) -> (N, T, d_hidden)
        # On CPU a batch_first LSTM returns a transposed view; a p2p send of it fails ("input tensor has
        # to be contiguous") when a pipeline cut follows this layer.
        return self.lstm(x)[0].contiguous()


class VocabLogits(nn.Module):
    """A linear map to vocabulary logits, laid out ``(N, vocab, T)`` as ``F.cross_entropy`` wants them."""

    def __init__(self, d_in: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, d_in) -> (N, vocab, T)
        return self.proj(x).transpose(1, 2)


def lstm_lm(vocab: int = 96, embed: int = 64, hidden: int = 256, layers: int = 2) -> nn.Sequential:
    """An LSTM language model (as in PipeDream's AWD-LM runs, arXiv:1806.03377 §5, much smaller).

    Embedding, ``layers`` single-layer LSTMs (one pipeline layer each), then vocabulary logits.
    The default vocabulary is :data:`CHARS`'s 96 characters (see :func:`char_text`).

    Shapes: input ``(N, T)`` long token ids, output ``(N, vocab, T)``; targets are ``(N, T)`` ids.
    """
    mods: list[nn.Module] = [nn.Embedding(vocab, embed)]
    d = embed
    for _ in range(layers):
        mods.append(LSTMLayer(d, hidden))
        d = hidden
    mods.append(VocabLogits(d, vocab))
    return nn.Sequential(*mods)


class Tokens(nn.Module):
    """Token embeddings plus learned position embeddings: ``(N, T)`` ids -> ``(N, T, width)``, both drawn
    with GPT-2's standard deviation 0.02 (a unit one, ``nn.Embedding``'s, would make a head tied to it
    give logits in the hundreds)."""

    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[:ids.shape[1]]


class CausalBlock(nn.Module):
    """A pre-norm transformer block whose attention sees only earlier positions (GPT-2's block)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                                batch_first=True, norm_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, width) -> (N, T, width)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


def gpt_like(vocab: int = 50257, width: int = 768, depth: int = 12, heads: int = 12, context: int = 1024,
             tied: bool = False) -> nn.Sequential:
    """GPT-2 small's shape (Radford et al. 2019) built from ``torch.nn``: token and position embeddings,
    ``depth`` causal pre-norm blocks, a final LayerNorm and the vocabulary head, one pipeline layer each.
    The defaults are GPT-2 small's sizes: 163M parameters with the head untied from the embedding; with
    ``tied`` the head's weight is the token embedding's, as GPT-2 has it (124M).

    Shapes: input ``(N, T)`` long token ids with ``T <= context``, output ``(N, vocab, T)``.
    """
    model = nn.Sequential(Tokens(vocab, width, context), *[CausalBlock(width, heads) for _ in range(depth)],
                          nn.LayerNorm(width), VocabLogits(width, vocab))
    head, tokens = model[-1], model[0]
    assert isinstance(head, VocabLogits) and isinstance(tokens, Tokens)
    if tied:
        head.proj.weight = tokens.tokens.weight
    return model


CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
"""The character vocabulary: newline and printable ASCII (96); other characters read as ``?``."""


def char_text() -> str:
    """English text that ships with Python: the Zen of Python and the docstrings of a few stdlib modules.

    No download and no source files needed (docstrings are gone only under ``python -OO``; then the
    Zen alone remains, about 850 characters).
    """
    import argparse
    import collections
    import textwrap
    import unittest

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this

    zen = codecs.decode(this.s, "rot13")
    parts = [zen]
    for mod in (argparse, collections, textwrap, unittest):
        parts += [mod.__doc__ or ""]
        parts += [getattr(mod, n).__doc__ or "" for n in sorted(dir(mod))
                  if not n.startswith("_") and isinstance(getattr(mod, n), type)]
    return "\n".join(p for p in parts if p)


def char_lm_dataset(seq_len: int = 64, text: str | None = None) -> TensorDataset:
    """Character-level next-token pairs from ``text`` (default :func:`char_text`), non-overlapping windows.

    Returns a dataset of ``(x, y)`` with ``x, y`` of shape ``(seq_len,)`` long and ``y`` = ``x`` shifted by one.
    """
    index = {ch: i for i, ch in enumerate(CHARS)}
    ids = torch.tensor([index.get(ch, index["?"]) for ch in (text if text is not None else char_text())])
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise ValueError(f"char_lm_dataset: {len(ids)} characters make no window of seq_len={seq_len}")
    x = ids[:n * seq_len].reshape(n, seq_len)
    y = ids[1:n * seq_len + 1].reshape(n, seq_len)
    return TensorDataset(x, y)


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model with what a benchmark needs around it.

    Attributes:
        factory: builds the model; keyword arguments are its size knobs.
        input_shape: one sample's input shape (the batch dimension left out).
        input_dtype: ``torch.float32`` images/vectors, or ``torch.long`` token ids.
        target_shape: one sample's target shape: ``()`` for a class label, ``(T,)`` for a sequence.
        classes: number of classes (the vocabulary for a language model).
        loss_fn: ``loss_fn(output, target)``, mean over the batch.
    """

    factory: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    target_shape: tuple[int, ...]
    classes: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy

    def dataset(self, n: int = 256, seed: int = 0) -> TensorDataset:
        """``n`` synthetic samples of the right shapes: normal inputs (or random ids) and random labels."""
        g = torch.Generator().manual_seed(seed)
        if self.input_dtype.is_floating_point:
            x = torch.randn(n, *self.input_shape, generator=g, dtype=self.input_dtype)
        else:
            x = torch.randint(self.classes, (n, *self.input_shape), generator=g, dtype=self.input_dtype)
        y = torch.randint(self.classes, (n, *self.target_shape), generator=g)
        return TensorDataset(x, y)


SPECS: dict[str, ModelSpec] = {
    "digits-cnn": ModelSpec(digits_cnn, (1, 8, 8), torch.float32, (), 10),
    "vgg-like": ModelSpec(vgg_like, (3, 32, 32), torch.float32, (), 10),
    "alexnet-like": ModelSpec(alexnet_like, (3, 32, 32), torch.float32, (), 10),
    "resnet-like": ModelSpec(resnet_like, (3, 32, 32), torch.float32, (), 10),
    "mnist-mlp": ModelSpec(mnist_mlp, (784,), torch.float32, (), 10),
    "lstm-lm": ModelSpec(lstm_lm, (64,), torch.long, (64,), len(CHARS)),
    "gpt-like": ModelSpec(functools.partial(gpt_like, vocab=4096, width=256, depth=8, heads=8, context=64), (64,),
                          torch.long, (64,), 4096),
}
"""Each zoo model at its default size. Synthetic data only; ``char_lm_dataset`` is real text for lstm-lm."""

MODELS: dict[str, Callable[..., nn.Module]] = {name: spec.factory for name, spec in SPECS.items()}
