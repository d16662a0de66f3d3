"""Evaluation metrics for ``pipetrain.train(metrics=...)`` (``function(output, target)`` -> a minibatch's
mean), and the metrics log a job writes with ``log_dir`` (``pipetrain plot``)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def logits_of(output: Any) -> torch.Tensor:
    """The scores in a model's output: the tensor itself, or its ``logits`` (Hugging Face ``ModelOutput``,
    a dict)."""
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    return getattr(output, "logits", output)


def accuracy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The fraction of samples (or tokens) whose highest score is the target class."""
    return (logits_of(output).argmax(dim=-1) == target).double().mean()


METRICS = {"accuracy": accuracy}
"""The metrics the command line knows by name (``--metrics accuracy``)."""


def read_log(path: str | os.PathLike) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The update and evaluation records of a metrics log (``log_dir/metrics.jsonl``, or the directory),
    one per step: a step trained again after a restart keeps its newest record.

    Raises:
        ValueError: the log is missing, or a line is not a record of it.
    """
    file = Path(path) / "metrics.jsonl" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: no metrics log there; train with log_dir=DIR (CLI: --log-dir DIR) first")
    kinds: dict[str, dict[int, dict[str, Any]]] = {"update": {}, "eval": {}}
    for n, line in enumerate(file.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
            kinds[record["kind"]][int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{file}:{n}: not a pipetrain metrics record; give the metrics.jsonl a job wrote") from None
    return ([kinds["update"][s] for s in sorted(kinds["update"])], [kinds["eval"][s] for s in sorted(kinds["eval"])])


def plot_log(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Draw a metrics log to PNG: the training loss per update with the evaluation loss beside it, and
    each evaluation metric in a panel of its own."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    updates, evals = read_log(path)
    names = sorted({k for e in evals for k in e} - {"kind", "epoch", "step", "loss"})
    fig, axes = plt.subplots(1 + len(names), 1, figsize=(7, 3 + 2.2 * len(names)), sharex=True, squeeze=False)
    loss_ax = axes[0][0]
    loss_ax.plot([u["step"] for u in updates], [u["loss"] for u in updates], lw=0.8, label="training loss")
    if evals:
        loss_ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="evaluation loss")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    for ax, name in zip((row[0] for row in axes[1:]), names):
        ax.plot([e["step"] for e in evals if name in e], [e[name] for e in evals if name in e], "o-", color="C2")
        ax.set_ylabel(name)
    axes[-1][0].set_xlabel("update")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
