"""Datasets that need no download: scikit-learn's bundled digits, and generated data."""
from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def digits(split: str = "train", image: bool = True, test_fraction: float = 0.2, seed: int = 0,
           dtype: torch.dtype = torch.float32) -> TensorDataset:
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), split deterministically.

    Args:
        split: ``train`` or ``test``.
        image: shape inputs as (1, 8, 8) images; otherwise flat 64-vectors.
        test_fraction: share of the images held out for ``test``.
        seed: the shuffle that decides the split.
    """
    from sklearn.datasets import load_digits

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    d = load_digits()
    x = torch.tensor(d.data, dtype=dtype) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(len(x) * (1 - test_fraction))
    idx = order[:cut] if split == "train" else order[cut:]
    x = x[idx].reshape(-1, 1, 8, 8) if image else x[idx]
    return TensorDataset(x, y[idx])


def regression(n: int = 256, d_in: int = 8, d_out: int = 4, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> TensorDataset:
    """A random linear-plus-noise regression problem, for exactness tests and quick runs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=dtype)
    w = torch.randn(d_in, d_out, generator=g, dtype=dtype)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, d_out, generator=g, dtype=dtype))
