"""How minibatches are drawn from a dataset and built, the same way in every worker, the profiler
and the solo replay."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset, default_collate


def epoch_order(n_items: int, batch_size: int, epoch: int, shuffle: bool, seed: int, multiple: int) -> list[list[int]]:
    """Dataset indices of each minibatch of ``epoch``.

    Without shuffling, minibatch t (0-based) is items [t*B, (t+1)*B). The tail that does not fill a
    minibatch, and the minibatches that do not fill a round of every replica (``multiple``), are dropped.
    """
    if shuffle:
        order = torch.randperm(n_items, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    else:
        order = list(range(n_items))
    return [order[t * batch_size:(t + 1) * batch_size] for t in range(per_epoch(n_items, batch_size, multiple))]


def per_epoch(n_items: int, batch_size: int, multiple: int) -> int:
    """Minibatches in an epoch: whole minibatches only, in whole rounds of ``multiple``."""
    return n_items // batch_size // multiple * multiple


def collate_parts(dataset: Any, items: Sequence[int], parts: Sequence[int]) -> list[Any]:
    """The inputs (part 0) and/or targets (part 1) of ``dataset``'s ``items``, as a worker builds them:
    each item fetched once (by the dataset's ``__getitems__`` where it has one, as ``DataLoader`` does),
    each part collated with ``default_collate``. A ``TensorDataset``'s rows are taken by indexing its
    tensors, which gives the tensors ``default_collate`` would stack. Fetching each item once also runs
    a dataset's random transform once per item."""
    if type(dataset) is TensorDataset:
        index = torch.as_tensor(list(items), dtype=torch.long)
        return [dataset.tensors[part][index] for part in parts]
    fetch = getattr(dataset, "__getitems__", None)
    samples = fetch(list(items)) if fetch is not None else [dataset[j] for j in items]
    return [default_collate([sample[part] for sample in samples]) for part in parts]


def first_inputs(dataset: Any, rows: int) -> Any:
    """The model input of the dataset's first ``rows`` items (fewer if it has fewer), collated."""
    return collate_parts(dataset, range(min(rows, len(dataset))), (0,))[0]


def microbatch(value: Any, micro: int | None, m: int) -> Any:
    """Microbatch ``micro`` of ``m`` equal slices of a collated value (a tensor, or a tuple or list of
    tensors); the whole value for ``micro`` None."""
    if micro is None or m == 1:
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(v.chunk(m)[micro] for v in value)
    return value.chunk(m)[micro]


def to_device(value: Any, device: torch.device) -> Any:
    """A collated value (a tensor, or nested tuples or lists of tensors) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return type(value)(to_device(v, device) for v in value)
