"""One training job for the GPU tests, run as a script so that the same job can run with the GPU and
with it hidden (``CUDA_VISIBLE_DEVICES=""``): ``python tests/gpu/job.py OUT OPTIONS_JSON``.

OPTIONS_JSON holds ``pipetrain.train``'s options as the CLI names them (``strategy``, ``schedule``,
``microbatches``, ``staleness``, ``compression``, ``chunk``, ``stages``, ``workers``, ...) and ``model``:
``"mlp64"`` (float64, for exactness), ``"mlp32"`` (float32, for bf16), ``"wide"`` (float32, 4 MiB layers,
for memory), ``"shape-branch"`` (float64, a
model ``torch.fx`` cannot trace and ``torch.export`` can) or ``"tied"`` (float64, its first and fifth layers
share their weight: with ``stages=[0, 3]`` each stage holds a copy). With ``"weights": PATH`` the model is built
on the meta device and each worker loads its stage from that file; the trained model is then saved
stage by stage (``OUT.safetensors``) and read back, as it is never gathered. OUT gets the result's state,
history, sync stats, traces, bytes sent and peak memory, and whether the workers had a GPU.
"""
from __future__ import annotations

import functools
import json
import sys

import torch
from safetensors.torch import load_file, save_file
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


def wide() -> nn.Sequential:
    """Float32, 1024 wide: 8 -> 1024, six 1024 x 1024 layers (4 MiB each), -> 4, Tanh between."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 1024), nn.Tanh()]
    for _ in range(6):
        layers += [nn.Linear(1024, 1024), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(1024, 4))


def build(kind: str, dtype: torch.dtype) -> nn.Module:
    if kind == "wide":
        return wide()
    return ShapeBranch().to(dtype) if kind == "shape-branch" else tied() if kind == "tied" else mlp(dtype)


def main(out: str, options: dict) -> None:
    kind = options.pop("model", "mlp64")
    dtype = torch.float32 if kind in ("mlp32", "wide") else torch.float64
    weights = options.pop("weights", None)
    if weights is None:
        model = build(kind, dtype)
    else:
        with torch.device("meta"):
            model = build(kind, dtype)
    own = {k: options.pop(k) for k in STRUCTURAL if k in options}
    if weights is not None:
        own.update(weights=weights, save=f"{out}.safetensors")
    strategy, schedule = from_options(**{"strategy": "pipeline", **options})
    result = pipetrain.train(model, data(dtype), loss_fn=nn.functional.mse_loss,
                             optimizer=functools.partial(torch.optim.SGD, lr=own.pop("lr", 0.05)),
                             strategy=strategy, schedule=schedule, shuffle=False, batch_size=own.pop("batch_size", 16),
                             timeout=120, **own)
    state = result.model.state_dict() if result.model is not None else load_file(f"{out}.safetensors")
    torch.save({"state": state, "history": result.history, "sync_stats": result.sync_stats, "traces": result.traces,
                "bytes_sent": result.bytes_sent, "peak_memory": result.peak_memory,
                "peak_device_memory": result.peak_device_memory, "predicted_memory": result.predicted_memory,
                "gpu": torch.cuda.is_available()}, out)


def write_weights(path: str, kind: str = "mlp64") -> None:
    """The model's initial weights as one safetensors file (for ``"weights"``)."""
    save_file(build(kind, torch.float32 if kind == "mlp32" else torch.float64).state_dict(), path)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
