"""Run a module with other tensors in place of its parameters (a stashed weight version, a tied copy).

``torch.func.functional_call`` does this, but it works out anew on every call which of the module's
slots each name fills (walking every submodule for tied aliases): 0.06-0.17 ms per call on a
three-layer MLP, up to 2% of a small stage's step on a CPU core and more of one on a GPU, paid by every
forward of a stashing schedule. A stage calls with the same names every time, so :func:`call_with`
works the slots out once per module and set of names, and then only puts the tensors in and takes them
out again. What it swaps is what ``functional_call`` swaps (``_parameters`` and ``_buffers`` entries,
every alias of a tied parameter included); names it cannot place go through ``functional_call``.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

Slot = tuple[dict[str, Any], str, str]
"""A module's ``_parameters`` or ``_buffers`` dict, the entry's name in it, and the full name it takes."""

_SLOTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], list[Slot] | None]] = weakref.WeakKeyDictionary()


def _slots(module: nn.Module, names: tuple[str, ...]) -> list[Slot] | None:
    """Every slot that holds the tensor one of ``names`` names, aliases included; None where a name is
    no parameter or buffer of ``module``."""
    owned = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    if any(n not in owned for n in names):
        return None
    by_id = {id(owned[n]): n for n in names}
    return [(table, attr, by_id[id(t)]) for sub in module.modules() for table in (sub._parameters, sub._buffers)
            for attr, t in table.items() if t is not None and id(t) in by_id]


def call_with(module: nn.Module, weights: dict[str, torch.Tensor], args: tuple[Any, ...],
              kwargs: dict[str, Any] | None = None) -> Any:
    """``module(*args, **kwargs)`` with ``weights`` (full names) in place of its tensors of those names."""
    names = tuple(weights)
    known = _SLOTS.get(module)
    if known is None:  # (setdefault would make a weak reference on every call)
        known = _SLOTS[module] = {}
    if names not in known:
        known[names] = _slots(module, names)
    slots = known[names]
    if slots is None:
        return functional_call(module, weights, args, kwargs)
    kept = [table[attr] for table, attr, _ in slots]
    try:
        for table, attr, name in slots:
            table[attr] = weights[name]
        return module(*args, **(kwargs or {}))
    finally:
        for (table, attr, _), t in zip(slots, kept):
            table[attr] = t
