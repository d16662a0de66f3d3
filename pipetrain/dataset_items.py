"""What a dataset must hold to be trained on, checked on its first item before any worker starts."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pipetrain.batches import TargetKey, target_keys
from pipetrain.errors import one_line
from pipetrain.streams import count, head, is_stream


def check_items(dataset: Any, what: str, target_key: TargetKey,
                 collate_fn: Callable[[list[Any]], Any] | None, counted: bool = True) -> int | None:
    """The item count of a dataset (a map-style one, or a stream: :mod:`pipetrain.streams`) of (input,
    target) pairs or of dictionaries holding ``target_key`` and at least one input (after ``collate_fn``,
    which is tried on item 0), or a one-line ValueError. A stream without a length is read once to count
    it, unless ``counted`` is False (None then)."""
    try:
        first = head(dataset, 1)
        n_items = (count(dataset, what) if counted else None) if is_stream(dataset) else len(dataset)
        if not len(first):
            raise ValueError(f"{what} is empty")
        item = first[0]
    except ValueError:
        raise
    except Exception as e:  # a dataset raises what it likes; all mean it cannot be used
        raise ValueError(f"{what} cannot be read ({one_line(e)}); give a map-style dataset (len() and [i]) or an "
                         "IterableDataset, of (input, target) pairs or of dictionaries") from None
    if collate_fn is None:
        sample, where = item, f"{what}'s items"
    else:
        try:
            sample, where = collate_fn([item]), f"the minibatches collate_fn builds from {what}"
        except Exception as e:  # the user's collate_fn may raise anything
            raise ValueError(f"collate_fn failed on {what}'s item 0 ({one_line(e)}); give a function from a list of "
                             "items to a minibatch") from None
    if not isinstance(sample, Mapping) and (not isinstance(sample, (tuple, list)) or len(sample) != 2):
        kind = f"a {type(sample).__name__}" + (f" of {len(sample)}" if isinstance(sample, (tuple, list)) else "")
        raise ValueError(f"{where} must be (input, target) pairs or dictionaries, but "
                         f"{'item 0' if collate_fn is None else 'that of item 0'} is {kind}; make each (input, "
                         "target) or a dict of the model's keyword inputs and the target")
    if isinstance(sample, Mapping):
        keys, has = target_keys(target_key), ", ".join(map(repr, sample))
        missing = [k for k in keys if k not in sample]
        if missing:
            raise ValueError(f"target_key {missing[0]!r} is not in {where} (item 0 has keys {has}); pass "
                             "target_key= naming the entry that is the target")
        if all(k in keys for k in sample):
            raise ValueError(f"{where} hold only the target ({has}); give the model's inputs as the other entries")
    if n_items is not None and n_items < 1:
        raise ValueError(f"{what} is empty")
    return n_items
