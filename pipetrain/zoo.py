"""Small models shaped like the papers', sized for CPUs; shared by the demo, tests and benchmarks."""
from __future__ import annotations

from torch import nn


def digits_cnn(width: int = 32) -> nn.Sequential:
    """A small CNN for 1x8x8 digit images: two conv blocks, then a fully connected head (10 classes)."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 16, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )


MODELS = {"digits-cnn": digits_cnn}
