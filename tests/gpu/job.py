"""One training job for the GPU tests, run as a script so that the same job can run with the GPU and
with it hidden (``CUDA_VISIBLE_DEVICES=""``): ``python tests/gpu/job.py OUT OPTIONS_JSON``.

OPTIONS_JSON holds ``pipetrain.train``'s options as the CLI names them (``strategy``, ``schedule``,
``microbatches``, ``staleness``, ``compression``, ``chunk``, ``stages``, ``workers``, ...) and ``model``:
``"mlp64"`` (float64, for exactness), ``"mlp32"`` (float32, for bf16), ``"shape-branch"`` (float64, a
model ``torch.fx`` cannot trace and ``torch.export`` can) or ``"tied"`` (float64, its first and fifth layers
share their weight: with ``stages=[0, 3]`` each stage holds a copy). OUT gets the result's state, history, sync stats,
traces and bytes sent, and whether the workers had a GPU.
"""
from __future__ import annotations

import functools
import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import pipetrain
from pipetrain.registry import from_options

STRUCTURAL = ("stages", "workers", "epochs", "batch_size", "checkpoint_dir", "resume", "trace", "precision",
              "backend", "lr")
"""The options that are ``train``'s own; the rest name the strategy and schedule."""


def mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4)).to(dtype)


class ShapeBranch(nn.Module):
    """Control flow on a shape: ``torch.fx`` cannot trace it, ``torch.export`` captures it for one shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.shape[0] > 1:
            h = h * 2
        return self.b(h)


def tied() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))
    model[4].weight = model[0].weight
    return model.double()


def data(dtype: torch.dtype, n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g, dtype=dtype), torch.randn(n, 4, generator=g, dtype=dtype))


def main(out: str, options: dict) -> None:
    kind = options.pop("model", "mlp64")
    dtype = torch.float32 if kind == "mlp32" else torch.float64
    model = ShapeBranch().to(dtype) if kind == "shape-branch" else tied() if kind == "tied" else mlp(dtype)
    own = {k: options.pop(k) for k in STRUCTURAL if k in options}
    strategy, schedule = from_options(**{"strategy": "pipeline", **options})
    result = pipetrain.train(model, data(dtype), loss_fn=nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=own.pop("lr", 0.05)),
                             strategy=strategy, schedule=schedule, shuffle=False, batch_size=own.pop("batch_size", 16),
                             timeout=120, **own)
    torch.save({"state": result.model.state_dict(), "history": result.history, "sync_stats": result.sync_stats,
                "traces": result.traces, "bytes_sent": result.bytes_sent, "gpu": torch.cuda.is_available()}, out)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
