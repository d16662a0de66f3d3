"""How minibatches are drawn from a dataset and built, the same way in every worker, the profiler
and the solo replay.

A dataset's items are ``(input, target)`` pairs, or dictionaries (Hugging Face style: ``{"input_ids",
"attention_mask", "labels"}``) whose ``target_key`` entry (or entries) is the target and whose other
entries are the model's keyword inputs. A collated minibatch's model input is therefore a value (the
model is called ``model(x)``) or :class:`KeywordInputs` (``model(**x)``): :func:`call` calls a module
either way. Keyword inputs are their own type so that a pair whose input is a dict keeps passing it
as one positional argument, as it always has.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from pipetrain.streams import head
from pipetrain.weightswap import call_with

TargetKey = str | Sequence[str]
"""The entry of a dictionary item that is the target, or several (the target is then their tuple)."""

DEFAULT_TARGET_KEY = "labels"


class KeywordInputs(dict):
    """A minibatch's model input given by name: the entries of dictionary items other than the target."""


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


def collate_parts(dataset: Any, items: Sequence[int], parts: Sequence[int], target_key: TargetKey = DEFAULT_TARGET_KEY,
                  collate_fn: Callable[[list[Any]], Any] | None = None) -> list[Any]:
    """The inputs (part 0) and/or targets (part 1) of ``dataset``'s ``items``, as a worker builds them:
    each item fetched once (by the dataset's ``__getitems__`` where it has one, as ``DataLoader`` does),
    then collated as ``DataLoader(collate_fn=collate_fn)`` would (default: ``default_collate``) and split
    into inputs and targets (:func:`split_batch`). Pairs without a ``collate_fn`` collate each part on
    its own, and a ``TensorDataset``'s rows are taken by indexing its tensors, which gives the tensors
    ``default_collate`` would stack. Fetching each item once also runs a dataset's random transform
    once per item. A pure function of its arguments, so it may run in another process."""
    if collate_fn is None and type(dataset) is TensorDataset:
        index = torch.as_tensor(list(items), dtype=torch.long)
        return [dataset.tensors[part][index] for part in parts]
    fetch = getattr(dataset, "__getitems__", None)
    return collate_samples(fetch(list(items)) if fetch is not None else [dataset[j] for j in items], parts,
                           target_key, collate_fn)


def collate_samples(samples: list[Any], parts: Sequence[int], target_key: TargetKey = DEFAULT_TARGET_KEY,
                    collate_fn: Callable[[list[Any]], Any] | None = None) -> list[Any]:
    """The inputs (part 0) and/or targets (part 1) of a minibatch's fetched items (see
    :func:`collate_parts`)."""
    if collate_fn is None and not isinstance(samples[0], Mapping):
        return [default_collate([sample[part] for sample in samples]) for part in parts]
    whole = split_batch((collate_fn or default_collate)(samples), target_key)
    return [whole[part] for part in parts]


def split_batch(batch: Any, target_key: TargetKey) -> tuple[Any, Any]:
    """(model input, target) of a collated minibatch: a dict's ``target_key`` entry (a tuple of the
    entries, for several keys) is the target and its other entries the keyword inputs; anything else is
    an (input, target) pair."""
    if isinstance(batch, Mapping):
        keys = target_keys(target_key)
        target = batch[keys[0]] if isinstance(target_key, str) else tuple(batch[k] for k in keys)
        return KeywordInputs((k, v) for k, v in batch.items() if k not in keys), target
    inputs, target = batch
    return inputs, target


def target_keys(target_key: TargetKey) -> tuple[str, ...]:
    """The keys ``target_key`` names, as a tuple."""
    return (target_key,) if isinstance(target_key, str) else tuple(target_key)


def first_inputs(dataset: Any, rows: int, target_key: TargetKey = DEFAULT_TARGET_KEY,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
    """The model input of the dataset's first ``rows`` items (fewer if it has fewer), collated."""
    items = head(dataset, rows)
    return collate_parts(items, range(min(rows, len(items))), (0,), target_key, collate_fn)[0]


def call(module: nn.Module, x: Any, weights: dict[str, torch.Tensor] | None = None) -> Any:
    """``module`` on a minibatch's model input: ``module(**x)`` for :class:`KeywordInputs`, else
    ``module(x)``; with ``weights`` in place of the tensors of those names (:func:`call_with`)."""
    keywords = isinstance(x, KeywordInputs)
    if weights is None:
        return module(**x) if keywords else module(x)
    return call_with(module, weights, (), dict(x)) if keywords else call_with(module, weights, (x,))


def microbatch(value: Any, micro: int | None, m: int) -> Any:
    """Microbatch ``micro`` of ``m`` equal slices of a collated value (a tensor, or a tuple, list or
    dict of tensors: each tensor sliced, anything else kept); the whole value for ``micro`` None."""
    if micro is None or m == 1:
        return value
    if isinstance(value, dict):
        return type(value)((k, v.chunk(m)[micro] if isinstance(v, torch.Tensor) else v) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return type(value)(v.chunk(m)[micro] for v in value)
    return value.chunk(m)[micro]


def to_device(value: Any, device: torch.device) -> Any:
    """A collated value (a tensor, or nested tuples, lists or dicts of tensors; anything else kept) on
    ``device``."""
    return map_tensors(value, lambda t: t.to(device))


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """``numel * element_size`` summed over ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a nested tuple, list or dict, in order."""
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` on every tensor of a nested tuple, list or dict, each container keeping its type (so
    :class:`KeywordInputs` stay keyword inputs, which ``torch.utils._pytree`` would take for a leaf);
    other values (e.g. sizes) pass through."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def shapes_of(value: Any) -> Any:
    """The shapes in a collated value (a tensor, or nested tuples, lists or dicts of tensors), to compare
    one minibatch's with another's."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, dict):
        return {k: shapes_of(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(shapes_of(v) for v in value)
    return type(value).__name__
