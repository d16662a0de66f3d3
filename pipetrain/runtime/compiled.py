"""Compiled stages (``train(compile=True)``): each worker runs its stage's forward through ``torch.compile``.

[Note: what is compiled] The unit is the whole stage module a worker calls (for data parallelism the
whole model), not each layer. Everything the runtime does around a forward works at the stage: weight
versions and tied copies are swapped into the stage's parameter slots
(:func:`pipetrain.weightswap.call_with`, as ``torch.func.functional_call`` swaps them), recomputation
replays the stage, the split backward walks the stage's autograd graph. One graph per stage gives
inductor the most to fuse and the fewest graph boundaries. torchtitan compiles each transformer block
instead so that identical blocks share one compiled graph and per-block FSDP and checkpointing wrap
around it; a pipeline stage holds a few layers, and inductor's on-disk graph cache already reuses the
code of a stage whose graph it has seen.

How it is done: the stage's own ``forward`` is replaced, on that instance, by a function calling
``torch.compile(forward)``. The module keeps its identity, names and ``state_dict`` (``torch.compile(module)``
would wrap it under ``_orig_mod.``), and ``nn.Module.compile`` is no choice: dynamo skips the call of a
module whose class is torch's own, such as the ``nn.Sequential`` a stage of layers is.

Weights are graph inputs, never constants: dynamo lifts a module's parameters into the graph's inputs, so
a stashed weight version or tied copy swapped in runs the same graph on its
own tensors. Guards recompile a stage a bounded number of times: once when its weights are copies
(plain tensors) rather than the live parameters (pipedream's stashing, 2bw), once for forwards
without gradients (evaluation, recompute's first run), once where data parallelism meets a batch of
other shapes (then compiled with dynamic shapes). A pipeline runs every minibatch in the first one's
shapes.

The backward is compiled with the forward (AOTAutograd): a compiled region is one autograd node that
computes its inputs' and its weights' gradients together, so zero-bubble's split backward cannot defer
the weights' part of it; see :func:`pipetrain.runtime.split_backward.fused_backward`.
"""
from __future__ import annotations

import functools
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PipetrainError, one_line


class CompileError(PipetrainError):
    """``torch.compile`` could not compile a stage; the message names the stage and what failed."""


def check_compilable(device: torch.device | None = None) -> None:
    """Raise a one-line ValueError where ``compile=True`` cannot work here: no dynamo for this Python
    or platform, no C++ compiler for inductor on the CPU, no triton on a GPU. Called before any
    worker starts."""
    import torch._dynamo  # noqa: PLC0415 - imported only where compile is asked for: it takes seconds

    try:
        supported = torch._dynamo.is_dynamo_supported()
    except RuntimeError as e:  # some torch builds raise instead of answering False
        raise ValueError(f"compile=True: torch.compile does not run here ({one_line(e)}); pass compile=False") from e
    if not supported:
        raise ValueError(f"compile=True: this torch {torch.__version__} has no torch.compile (dynamo) support for "
                         "this Python or platform; pass compile=False")
    where = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if where.type == "cuda":
        from torch.utils._triton import has_triton  # noqa: PLC0415

        if not has_triton():
            raise ValueError("compile=True on a GPU needs triton (pip install triton); pass compile=False")
    elif not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ValueError("compile=True on the CPU needs a C++ compiler for inductor (e.g. apt-get install g++); "
                         "pass compile=False")


def compile_stage(module: nn.Module, what: str, backend: str | Callable[..., Any] = "inductor") -> None:
    """Make ``module``'s calls run its forward through ``torch.compile`` with ``backend``, in place.
    ``what`` names it in a :class:`CompileError` (e.g. ``"stage 1 (layers 3-5)"``). Compilation happens
    at the first call (and again where a guard fails, see [Note: what is compiled])."""
    from torch._dynamo.exc import TorchDynamoException  # noqa: PLC0415 - seconds to import

    compiled = torch.compile(module.forward, backend=backend)

    @functools.wraps(module.forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except TorchDynamoException as e:
            raise CompileError(f"{what} could not be compiled: {failure(e)}; pass compile=False to run it "
                               "eagerly") from e

    module.forward = forward  # type: ignore[method-assign]



_FAKE_RUN = re.compile(r"call_\w+ ([\w.]+)\(.*\): got (\w+)\((.*)\)\s*$", re.M)
"""Dynamo's report of an operator that failed on fake tensors: the operator, the error's type and message."""


def failure(e: BaseException) -> str:
    """What failed in one line: the backend's own error (inductor's), or the operator dynamo could not
    run on fake tensors (one without a fake kernel, or a shape that does not fit, which eager would
    raise as well), or dynamo's explanation."""
    inner = getattr(e, "inner_exception", None)
    if inner is not None:
        return one_line(inner)
    text = str(e)
    op = _FAKE_RUN.search(text)
    if op:
        return f"operator {op[1]} failed: {op[2]}: {op[3].strip(chr(39) + chr(34))[:200]}"
    explained = [line.strip().removeprefix("Explanation: ") for line in text.splitlines() if "Explanation:" in line]
    return f"{type(e).__name__}: {explained[0][:200]}" if explained else one_line(e)
