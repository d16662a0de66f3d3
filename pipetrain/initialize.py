"""Initial weights for a model built on the meta device, the same however it is split into stages.

A model too big for any one machine can be built without memory (``with torch.device("meta"):
model = LlamaForCausalLM(config)``); each pipeline worker then initializes only the tensors of its own
stage. For that to train the model the user built, a tensor's initial value must not depend on the
split: one process initializing the whole model (:func:`materialize`) and a worker initializing one
stage (:func:`initial_values`) give every tensor the same value, bit for bit. The rule:

* Every tensor (parameter or buffer, persistent or not) belongs to the module that owns its *first
  name*: the first name ``model.named_parameters()`` / ``model.named_buffers()`` give that object. A tied
  ``lm_head.weight`` that is ``model.embed_tokens.weight`` belongs to ``model.embed_tokens`` and gets the
  embedding's initial value; every name of one object gets the one tensor.
* A module is initialized on its own, on the CPU (so the values do not depend on the device), with
  torch's CPU random generator forked and seeded with the first 63 bits of
  ``sha256(f"{seed}:{path}")``, ``path`` being the module's name in the model ("" for the model itself):

  1. if the module or a module enclosing it has ``_init_weights`` (a Hugging Face ``PreTrainedModel``, or
     a model written to run ``self.apply(self._init_weights)``), the nearest such one's
     ``_init_weights(module)``, as Hugging Face's own initialization calls it for each module;
  2. else the module's ``reset_parameters()`` (or ``_reset_parameters()``, as ``nn.MultiheadAttention``
     has), which torch's layers call in their ``__init__``: ``nn.Linear``, ``nn.Embedding``, the
     convolutions and norms (a batch norm's running statistics too) ...;
  3. a module that owns tensors and has neither cannot be initialized (unless an enclosing module's
     rule sets all its tensors, below): :class:`InitError`, which says to pass ``weights=`` (a file
     holding the model's weights) or to give the module a ``reset_parameters()``.

  Then, as torch and Hugging Face both initialize a parent after its children, each enclosing module,
  nearest first, is initialized the same way (1 or 2, nothing if neither) in the same random stream, with
  only this module's tensors real: a parent that sets its children's weights (GPT-2's attention and MLP
  scale their ``c_proj`` by the depth, ``nn.MultiheadAttention`` zeroes its ``out_proj.bias``,
  ``nn.Transformer`` redraws every matrix) so has the last word, as it has when the model is built whole.
* Only the module's own tensors are made real; its children and the rest of the model stay on the meta
  device, and all of it happens on a private copy of the model's module tree, so the caller's model is
  never changed. Floating-point tensors start as NaN: one still holding NaN after rule 1 is given rule 2's
  value where the module has ``reset_parameters()``, else it is an :class:`InitError` naming it. Integer
  and bool buffers (a batch norm's ``num_batches_tracked``) start as zero and are trusted to rules 1 and 2.

Buffers that a model computes in its ``__init__`` (which meta construction leaves without values) are
the initializer's to recompute. Hugging Face's transformers 5 does so in ``_init_weights``: Llama's
non-persistent rotary ``inv_freq`` and ``original_inv_freq`` are recomputed from the config (a model
moved off the meta device with ``to_empty`` alone keeps them uninitialized, the known pitfall of rotary
embeddings after meta construction), BERT's ``position_ids`` likewise; GPT-2 holds no buffers. A
floating-point buffer that neither rule sets is left NaN, hence an error.

The values depend on the seed, the module's path, its tensors' shapes and dtypes, and the torch and
transformers versions (which fix what an initializer draws, in which order); not on the split, the
device, the process, or the caller's random state, which is left as it was.
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["InitError", "initial_values", "assign", "materialize", "meta_names", "check_initializable"]

REMEDY = "pass weights= (a .safetensors file or directory of the model's weights)"
"""What an :class:`InitError` tells the user to do instead of initializing."""


class InitError(ValueError):
    """A module's tensors cannot be initialized by the rule (see the module's docstring); one line,
    naming the module and what to do."""


def seed_of(seed: int, path: str) -> int:
    """The generator seed for the module named ``path``: stable across processes and Python runs,
    which ``hash()`` is not."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "big") >> 1


def meta_names(module: nn.Module) -> list[str]:
    """The names (every alias of a tied tensor) of ``module``'s parameters and buffers still on the meta
    device."""
    return [name for name, t in _tensors(module).items() if t.is_meta]


def initial_values(model: nn.Module, names: Iterable[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """The CPU values :func:`materialize` gives the tensors ``names`` (as ``named_parameters`` and
    ``named_buffers`` with ``remove_duplicate=False`` name them), computing only the modules owning them,
    so a worker can initialize its stage of a model that fits nowhere whole. Names of one object get one
    tensor. A tensor of ``names`` not on the meta device is returned as it is (a copy)."""
    names = list(names)
    tensors = _tensors(model)
    for name in names:
        if name not in tensors:
            raise ValueError(f"{type(model).__name__} has no parameter or buffer named {name!r}")
    copies: dict[int, torch.Tensor] = {}
    out = {name: _memo(copies, tensors[name], lambda t: t.detach().clone()) for name in names
           if not tensors[name].is_meta}
    wanted = [name for name in names if tensors[name].is_meta]
    if wanted:
        tree = _Tree(model)
        owners = {tree.owner(name) for name in wanted}
        values = {key: value for path in sorted(owners) for key, value in tree.initialize(path, seed).items()}
        out.update({name: values[id(tree.tensors[name])] for name in wanted})
    return out


def check_initializable(model: nn.Module) -> None:
    """Raise :class:`InitError` for the first module owning meta tensors that no rule reaches (neither it
    nor a module enclosing it has ``_init_weights`` or ``reset_parameters()``), without initializing
    anything: the caller's check before any worker starts. A rule that runs but leaves a tensor unset is
    found only when it runs (:func:`initial_values`)."""
    tree = _Tree(model)
    owners = {tree.owner(name) for name in meta_names(model)}
    for path in sorted(owners):
        if not any(any(tree.rules(p)) for p in [path, *_enclosing(path)]):
            module = tree.root.get_submodule(path)
            name = next(n for n in meta_names(model) if tree.owner(n) == path)
            raise tree.error(path, module, name, None, None)


def assign(module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Put each of ``values`` into ``module`` under its name: a parameter as an ``nn.Parameter`` keeping
    its ``requires_grad``, a buffer as a buffer keeping its persistence. Names that shared one object
    share the new one, those not in ``values`` included, so tied weights stay tied (where several
    aliases are given, the value of the first the model names is used)."""
    tensors = _tensors(module)
    for name, value in values.items():
        old = tensors.get(name)
        if old is None:
            raise ValueError(f"{type(module).__name__} has no parameter or buffer named {name!r}")
        if value.shape != old.shape or value.dtype != old.dtype:
            raise ValueError(f"{name!r} is {old.dtype} {tuple(old.shape)} in {type(module).__name__}, "
                             f"the value given is {value.dtype} {tuple(value.shape)}")
    new: dict[int, torch.Tensor] = {}
    for name, old in tensors.items():  # the model's order, so a tie takes its first-named value
        if name in values and id(old) not in new:
            value = values[name].detach()
            new[id(old)] = nn.Parameter(value, old.requires_grad) if isinstance(old, nn.Parameter) else value
    for slots, attr in _slots(module):
        old = slots[attr]
        if old is not None and id(old) in new:
            slots[attr] = new[id(old)]


def materialize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Replace every meta tensor of ``model`` by its initial value (on the CPU, ties kept), in place, and
    return the model: the whole model as the workers of any split would initialize its stages."""
    names = meta_names(model)
    if names:
        assign(model, initial_values(model, names, seed))
    return model


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` under each of its names."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def _slots(module: nn.Module) -> list[tuple[dict[str, Any], str]]:
    """Where ``module`` and its descendants hold tensors: (a module's ``_parameters`` or ``_buffers``,
    attribute), each module once however many names it has."""
    return [(slots, attr) for m in module.modules() for slots in (m._parameters, m._buffers) for attr in slots]


def _memo(memo: dict[int, torch.Tensor], t: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(t)``, made once per tensor object, so aliases keep sharing."""
    if id(t) not in memo:
        memo[id(t)] = make(t)
    return memo[id(t)]


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor like ``t``, a parameter if it is one: what the private tree holds, so that no
    initializer can write into the caller's tensors."""
    s = torch.empty_like(t, device="meta")
    return nn.Parameter(s, t.requires_grad) if isinstance(t, nn.Parameter) else s


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor like ``t`` that shows whether an initializer set it: NaN where NaN can be held."""
    v = torch.empty_like(t, device="cpu")
    if _checkable(v):
        v.fill_(float("nan"))
    else:
        v.zero_()
    return nn.Parameter(v, t.requires_grad) if isinstance(t, nn.Parameter) else v


def _checkable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _enclosing(path: str) -> list[str]:
    """The paths of the modules enclosing the one at ``path``, nearest first, the model ("") last."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _describe(path: str, module: nn.Module) -> str:
    return f"module {path!r} ({type(module).__name__})" if path else f"the model ({type(module).__name__})"


class _Tree:
    """A private copy of a model's module tree whose tensors are all meta stand-ins (ties kept), in which
    one module at a time gets real tensors and is initialized."""

    def __init__(self, model: nn.Module) -> None:
        stand_ins: dict[int, torch.Tensor] = {}
        clones = {id(m): copy.copy(m) for m in model.modules()}
        for m in model.modules():
            clone = clones[id(m)]
            # new dicts, so that nothing done to the copy reaches the model
            clone.__dict__["_parameters"] = {k: None if t is None else _memo(stand_ins, t, _stand_in)
                                             for k, t in m._parameters.items()}
            clone.__dict__["_buffers"] = {k: None if t is None else _memo(stand_ins, t, _stand_in)
                                          for k, t in m._buffers.items()}
            clone.__dict__["_modules"] = {k: None if c is None else clones[id(c)] for k, c in m._modules.items()}
        self.root = clones[id(model)]
        self.tensors = _tensors(self.root)
        first = {**dict(self.root.named_parameters()), **dict(self.root.named_buffers())}
        self.first = {id(t): name for name, t in first.items()}
        self.slots: dict[int, list[tuple[dict[str, Any], str]]] = {}
        for slots, attr in _slots(self.root):
            t = slots[attr]
            if t is not None:
                self.slots.setdefault(id(t), []).append((slots, attr))

    def owner(self, name: str) -> str:
        """The path of the module owning the tensor called ``name``."""
        return self.first[id(self.tensors[name])].rpartition(".")[0]

    def rules(self, path: str) -> tuple[Callable[[nn.Module], object] | None, Callable[[], object] | None]:
        """Rule 1 (the nearest enclosing ``_init_weights``) and rule 2 (``reset_parameters``) for the
        module at ``path``, each None where it has none."""
        module = self.root.get_submodule(path)
        enclosing = (self.root.get_submodule(p) for p in [path, *_enclosing(path)])
        init = next((getattr(m, "_init_weights") for m in enclosing if hasattr(m, "_init_weights")), None)
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        return init, reset

    def apply(self, path: str) -> tuple[Callable[[nn.Module], object] | None, Callable[[], object] | None]:
        """Initialize the module at ``path`` by rule 1, else rule 2; the rules it has."""
        init, reset = self.rules(path)
        if init is not None:
            init(self.root.get_submodule(path))
        elif reset is not None:
            reset()
        return init, reset

    def initialize(self, path: str, seed: int) -> dict[int, torch.Tensor]:
        """The initial values of the tensors the module at ``path`` owns, by id of their stand-in."""
        module = self.root.get_submodule(path)
        owned = {id(t): t for slots in (module._parameters, module._buffers) for t in slots.values()
                 if t is not None and self.first[id(t)].rpartition(".")[0] == path}
        saved = [(slots, attr, slots[attr]) for key in owned for slots, attr in self.slots[key]]
        try:
            self.put({key: _fresh(t) for key, t in owned.items()})
            with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():
                # the CPU generator alone: torch.manual_seed would reseed the caller's GPUs too
                torch.default_generator.manual_seed(seed_of(seed, path))
                return self.run(path, module, owned)
        finally:
            for slots, attr, t in saved:
                slots[attr] = t

    def put(self, values: Mapping[int, torch.Tensor]) -> None:
        """Hold ``values`` in place of the stand-ins (by id) under every name."""
        for key, value in values.items():
            for slots, attr in self.slots[key]:
                slots[attr] = value

    def read(self, owned: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        # through the first name, which sees an initializer that rebinds a tensor instead of writing it
        values: dict[int, torch.Tensor] = {}
        for key in owned:
            slots, attr = self.slots[key][0]
            value = slots[attr]
            assert value is not None
            values[key] = value.detach()
        return values

    def run(self, path: str, module: nn.Module, owned: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Rule 1 or 2, the enclosing modules' rules, then rule 2 for what rule 1 left unset."""
        init, reset = self.apply(path)
        for outer in _enclosing(path):
            self.apply(outer)
        values = self.read(owned)
        unset = [key for key, v in values.items() if _checkable(v) and bool(v.isnan().any())]
        if unset and init is not None and reset is not None:
            kept = {key: v.clone() for key, v in values.items() if key not in unset}
            self.put({key: _fresh(owned[key]) for key in unset})
            reset()
            values = {**self.read(owned), **kept}
            unset = [key for key in unset if bool(values[key].isnan().any())]
        if init is None and reset is None:
            unset = unset or [key for key, v in values.items() if not _checkable(v)]
        if unset:
            raise self.error(path, module, self.first[unset[0]], init, reset)
        return values

    def error(self, path: str, module: nn.Module, name: str, init: Callable[[nn.Module], object] | None,
              reset: Callable[[], object] | None) -> InitError:
        cls = type(module).__name__
        tried = ([f"{type(getattr(init, '__self__', None)).__name__}._init_weights"] if init is not None else []) \
            + ([f"{cls}.{reset.__name__}()"] if reset is not None else [])
        if not tried:
            return InitError(f"{_describe(path, module)} sets its tensor {name!r} only in its __init__, so pipetrain "
                             f"cannot initialize it on a worker; {REMEDY}, or give {cls} a reset_parameters()")
        leave = "leave" if len(tried) > 1 else "leaves"
        return InitError(f"{_describe(path, module)}: {' and '.join(tried)} {leave} its tensor {name!r} unset, so "
                         f"pipetrain cannot initialize it on a worker; {REMEDY}, or make {tried[-1]} set it")
