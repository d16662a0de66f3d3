"""Loading ahead: training rate with and without background loaders, beside PyTorch DDP + DataLoader.

    flock /tmp/pipetrain-bench.lock env PYTHONPATH=$PWD python3 benchmarks/loaders.py [--repeats 3] [--json F]

A dataset whose every item waits 0.5 ms in ``__getitem__`` (a read from storage) feeds an MLP
(float32, 256 -> 512 -> 512 -> 512 -> 10, cross-entropy, SGD), batch 64, one epoch of ``--steps``
minibatches. Measured: pipetrain ``ddp`` on 2 workers and a 2-stage ``pipedream`` pipeline, each with
``loader_workers`` 0 and 2, and PyTorch's ``DistributedDataParallel`` (gloo, 2 processes, a
``DistributedSampler``) fed by ``DataLoader(num_workers=2)``. The rate is samples/s over the updates
after the first ``--warmup`` (from the update timestamps), the median of ``--repeats`` runs.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import pipetrain

BATCH, D_IN, HIDDEN, CLASSES = 64, 256, 512, 10
WAIT_S = float(os.environ.get("LOADERS_WAIT_MS", "0.5")) / 1e3
"""Each item's wait; ``LOADERS_WAIT_MS=0`` measures the same jobs with free items (what compute alone allows)."""


class SlowReads(torch.utils.data.Dataset):
    """Random inputs and labels; each item waits ``WAIT_S`` first, as a read from storage does."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, D_IN, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(WAIT_S)
        return self.x[i], self.y[i]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def rate(times: list[float], warmup: int) -> float:
    """Samples/s between the ``warmup``-th update and the last."""
    kept = times[warmup:]
    return BATCH * (len(kept) - 1) / (kept[-1] - kept[0])


def pipetrain_rate(layout: dict[str, Any], loaders: int, steps: int, warmup: int) -> float:
    result = pipetrain.train(model(), SlowReads(BATCH * steps), loss_fn=nn.functional.cross_entropy,
                             optimizer=functools.partial(torch.optim.SGD, lr=0.01), batch_size=BATCH, epochs=1,
                             loader_workers=loaders, **layout)
    return rate([h["time"] for h in result.history], warmup)


def _ddp_rank(rank: int, port: int, steps: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)  # as pipetrain's 2 workers on 2 cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    data = SlowReads(BATCH * steps)
    loader = DataLoader(data, batch_size=BATCH // 2, sampler=DistributedSampler(data, 2, rank, seed=0),
                        num_workers=2, prefetch_factor=2)
    net = DistributedDataParallel(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    times = []
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter())
    if rank == 0:
        Path(out).write_text(json.dumps(rate(times, warmup)))
    dist.destroy_process_group()


def ddp_dataloader_rate(steps: int, warmup: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "rate.json")
        tmp.spawn(_ddp_rank, args=(port, steps, warmup, out), nprocs=2)
        return float(json.loads(Path(out).read_text()))


RUNS = {
    "pipetrain ddp, 2 workers, loader_workers=0": lambda s, w: pipetrain_rate(dict(strategy="ddp", workers=2), 0, s, w),
    "pipetrain ddp, 2 workers, loader_workers=2": lambda s, w: pipetrain_rate(dict(strategy="ddp", workers=2), 2, s, w),
    "pipetrain pipedream, 2 stages, loader_workers=0": lambda s, w: pipetrain_rate(dict(stages=[0, 4]), 0, s, w),
    "pipetrain pipedream, 2 stages, loader_workers=2": lambda s, w: pipetrain_rate(dict(stages=[0, 4]), 2, s, w),
    "PyTorch DDP (gloo, 2 processes) + DataLoader(num_workers=2)": ddp_dataloader_rate,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="minibatches (updates) per run")
    p.add_argument("--warmup", type=int, default=10, help="updates left out of the rate")
    p.add_argument("--json", default=None, help="also write the rates to this file")
    args = p.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in RUNS}
    for _ in range(args.repeats):  # interleaved: each configuration sees the same phases of the machine
        for name, run in RUNS.items():
            rates[name].append(run(args.steps, args.warmup))
    print(f"| run | samples/s (median of {args.repeats}) | runs |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rates, indent=1))


if __name__ == "__main__":
    main()
