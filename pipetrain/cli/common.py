"""What the ``pipetrain`` subcommands share: the one-line-error parser, loading MODULE:NAME objects, the
loss, optimizer and ``--stages`` options, and pipetrain's warnings in one line."""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from pipetrain.errors import PipetrainWarning, one_line


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def load_object(path: str) -> Any:
    """``"package.module:name"`` -> that object (the current directory is importable, as for uvicorn)."""
    if ":" not in path:
        raise ValueError(f"{path!r} is not MODULE:NAME (e.g. mymodels:make_model)")
    module, name = path.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"cannot import {module!r} from {path!r}: {e}") from None
    except SyntaxError as e:
        raise ValueError(f"cannot import {module!r} from {path!r}: {e.msg} ({e.filename}, line {e.lineno})") from None
    except Exception as e:  # the module's own code failed at import: report it, not a traceback
        raise ValueError(f"importing {module!r} from {path!r} failed: {one_line(e)}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module!r} has no {name!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


def call_factory(path: str, wanted: str) -> Any:
    """The object ``path`` names, called when it is a factory; one-line errors for a failing factory or
    one that returns something other than ``wanted`` ("model": an nn.Module, "data": a map-style dataset)."""
    obj = load_object(path)
    if callable(obj) and not isinstance(obj, torch.nn.Module):
        try:
            obj = obj()
        except Exception as e:  # the user's factory failed: say so in one line
            raise ValueError(f"{path}() failed: {one_line(e)}") from None
    if wanted == "model" and not isinstance(obj, torch.nn.Module):
        raise ValueError(f"{path} gave a {type(obj).__name__}, not a torch.nn.Module; name a module or a function "
                         "returning one")
    if wanted == "data" and (isinstance(obj, torch.nn.Module) or not hasattr(obj, "__len__")
                             or not hasattr(obj, "__getitem__")):
        raise ValueError(f"{path} gave a {type(obj).__name__}, not a map-style dataset (len() and [i]); name a "
                         "Dataset or a function returning one")
    return obj


def load_loss(name: str) -> Callable[..., torch.Tensor]:
    """``--loss``: a ``torch.nn.functional`` name or MODULE:FUNCTION."""
    if ":" in name:
        return load_object(name)
    fn = getattr(torch.nn.functional, name, None)
    if fn is None:
        raise ValueError(f"unknown loss {name!r}; use a torch.nn.functional name (cross_entropy, mse_loss) "
                         "or MODULE:FUNCTION")
    return fn


def parse_stages(text: str) -> list[int | str]:
    """``--stages 0,2,4`` -> [0, 2, 4]; ``--stages transformer.h.2,transformer.h.4`` -> the names (the
    submodules later stages begin at); or a one-line error."""
    stages: list[int | str] = [int(x) if x.strip().lstrip("-").isdigit() else x.strip() for x in text.split(",")]
    if not text.strip() or any(s == "" for s in stages):
        raise ValueError(f"--stages {text!r}: give the first layer index of each stage, e.g. --stages 0,2,4, or the "
                         "submodule each later stage begins at, e.g. --stages transformer.h.2,transformer.h.4")
    return stages


def chunk_option(text: str) -> int | str:
    """``--chunk``: ``auto`` or an integer (checked by :class:`pipetrain.CGDP`)."""
    return int(text) if text.strip().lstrip("-").isdigit() else text.strip()


def one_line_warnings(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: Any = None, line: str | None = None) -> None:
    """pipetrain's warnings as one line each on stderr (others as Python prints them)."""
    if issubclass(category, PipetrainWarning):
        print(f"pipetrain: warning: {message}", file=sys.stderr)
    else:
        show_warning(message, category, filename, lineno, file, line)


show_warning = warnings.showwarning
"""Python's own ``warnings.showwarning``, put back when a command ends."""


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def add_optimizer_options(p: argparse.ArgumentParser) -> None:
    """``--optimizer``, ``--lr``, ``--momentum`` (read back by :func:`optimizer_of`)."""
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd", help="torch.optim optimizer (default sgd)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.0, help="sgd only")


def optimizer_of(args: argparse.Namespace) -> Callable[..., torch.optim.Optimizer]:
    """The optimizer factory the options name."""
    kw: dict[str, Any] = {"lr": args.lr}
    if args.optimizer == "sgd":
        kw["momentum"] = args.momentum
    return functools.partial(OPTIMIZERS[args.optimizer], **kw)
