"""The workload: a wide MLP on random data, 2 stages on 2 cores, and how long to measure it."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from pipetrain.registry import schedule_of

LR = 1e-3


@dataclass(frozen=True)
class Config:
    """What is measured, and for how long.

    Attributes:
        width, depth, classes: the MLP (:func:`wide_mlp`).
        batch: samples per minibatch; micro: microbatches for ``gpipe`` and ``1f1b-flush``.
        skip, tail: steps left out at the start (fill, allocator warm-up) and at the end (drain).
        minibatches: per run (one epoch); reps: real runs per schedule (and replays: one before each).
        trace_pairs: ``pipedream`` runs with tracing off and on, alternating.
        repeats: repetitions of each timing in this process (profiles, optimizer step, extras).
        link_rounds: ping-pong round trips per message size.
    """

    width: int = 1024
    depth: int = 8
    classes: int = 10
    batch: int = 256
    micro: int = 4
    skip: int = 6
    tail: int = 2
    minibatches: int = 48
    reps: int = 3
    trace_pairs: int = 5
    repeats: int = 10
    link_rounds: int = 30

    def __post_init__(self) -> None:
        if self.batch % self.micro or self.minibatches <= self.skip + self.tail or self.skip < 1:
            raise ValueError(f"{self}: batch must split into micro microbatches, and skip >= 1 and tail must leave "
                             "measured steps")

    @property
    def schedules(self) -> list[tuple[str, int]]:
        """(schedule, microbatches) in the order they run and are reported."""
        return [("pipedream", 1), ("gpipe", self.micro), ("1f1b-flush", self.micro), ("model-parallel", 1)]

    @property
    def measured(self) -> range:
        """The minibatch ids (0-based) whose steps the statistics use."""
        return range(self.skip, self.minibatches - self.tail)


PRESETS = {
    "full": Config(),
    "quick": Config(minibatches=24, reps=1, trace_pairs=2),
    # end to end in seconds: a model too small to say anything about the simulator
    "smoke": Config(width=64, depth=2, batch=32, skip=2, tail=1, minibatches=8, reps=2, trace_pairs=1, repeats=2,
                    link_rounds=3),
}


def wide_mlp(cfg: Config) -> nn.Sequential:
    """``depth`` x (Linear(width, width), ReLU), then Linear(width, classes): 2*depth + 1 layers.

    At the full size each Linear is 1.05M parameters (4.2 MB), so at batch 256 a Linear's forward is
    ~3.8 ms on one core of the reference machine while the activation crossing a cut is only 1 MB:
    compute dominates. Built after ``torch.manual_seed(0)``, so every process builds the same weights.
    """
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg.depth):
        layers += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
    layers.append(nn.Linear(cfg.width, cfg.classes))
    return nn.Sequential(*layers)


def make_data(cfg: Config, seed: int = 0) -> TensorDataset:
    """One epoch of ``minibatches`` random inputs and labels."""
    n = cfg.batch * cfg.minibatches
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, cfg.width, generator=g), torch.randint(cfg.classes, (n,), generator=g))


def train_options(cfg: Config, schedule: str, m: int, **changes: Any) -> dict[str, Any]:
    """The ``pipetrain.train`` options of every run of ``schedule`` with ``m`` microbatches (all but the
    model, data, stages and tracing), with ``changes``."""
    return {"loss_fn": F.cross_entropy, "optimizer": functools.partial(torch.optim.SGD, lr=LR),
            "schedule": schedule_of(schedule, m),
            "batch_size": cfg.batch, "epochs": 1, "shuffle": False, "threads": 1, **changes}
