"""Running examples/mlp_job.py as a user would: under torchrun, or as a plain script that launches
its own workers (shared by the torchrun tests)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_locally(strategy: str, out: Path, world: int) -> dict[str, torch.Tensor]:
    """The example as a plain script with ``world`` workers (WORLD_SIZE without RANK is not torchrun:
    pipetrain launches its own workers); its trained state_dict."""
    env = {**os.environ, "PIPETRAIN_EXAMPLE_OUT": str(out), "WORLD_SIZE": str(world)}
    env.pop("RANK", None)
    code = f"import runpy, sys; sys.argv=['x', '--strategy', '{strategy}']; " \
        "runpy.run_path('examples/mlp_job.py', run_name='__main__')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.load(out, weights_only=True)
