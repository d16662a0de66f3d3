"""pipetrain's run: the model built on the meta device, each worker reading its stage from the
checkpoint, 4 stages of equal decoder-layer counts under ``1f1b-flush``, the trained model saved
stage by stage; and the check that what was saved is what was trained.

[Note: the loss check] The recorded loss of an update is taken before it, so no update's loss is
the trained model's. The job therefore ends with one step more than it trains, at learning rate 0
(:func:`bigmodel.model.trained_then_probe`), on the first minibatch again: its forward and backward
run under the weights of the last real update, and SGD with learning rate 0 leaves them exactly as they
were, so its recorded loss is the loss of the very weights the workers then save. A fresh process
loads what they wrote with ``LlamaForCausalLM.from_pretrained`` and computes the loss of that
minibatch: same weights, same tokens, so the two agree to float rounding (pipetrain's is the mean
over microbatches), or the save lost or garbled something. The first update's loss is the same
minibatch's under the initial weights: that it differs shows the saved weights are the trained ones.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import TensorDataset
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import pipetrain
from bigmodel.model import lm_loss, meta_model, output_loss, stage_starts, trained_then_probe
from pipetrain.runtime.launch import spawn


def run_pipetrain(config: LlamaConfig, checkpoint: Path, out: Path, data: TensorDataset, batch: int,
                  microbatches: int, lr: float, threads: int, timeout: float) -> dict[str, Any]:
    """One epoch over ``data``, one SGD step per minibatch in order, the last at learning rate 0 ([Note:
    the loss check]), with ``weights=checkpoint`` and ``save=out``; what :mod:`bigmodel.report` shows."""
    rates = functools.partial(LambdaLR, lr_lambda=trained_then_probe(len(data) // batch))
    called = time.perf_counter()
    result = pipetrain.train(meta_model(config), data, loss_fn=output_loss, stages=stage_starts(config),
                             optimizer=functools.partial(torch.optim.SGD, lr=lr), lr_scheduler=rates,
                             schedule=pipetrain.OneFOneBFlush(microbatches), batch_size=batch, shuffle=False,
                             weights=checkpoint, save=out, threads=threads, timeout=timeout)
    predicted = getattr(result, "predicted_memory", None)  # per worker, where this pipetrain predicts it
    return {"call_s": time.perf_counter() - called, "phases": result.phases, "peak_memory": result.peak_memory,
            "predicted_memory": list(predicted) if predicted else None,
            "losses": [h["loss"] for h in result.history], "lrs": [h["lr"] for h in result.history]}


def saved_loss(directory: Path, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss on ``(x, y)`` of the model saved in ``directory`` (as ``save_pretrained`` lays it out),
    computed in a fresh process (started as pipetrain starts its workers), so that this one never holds
    the model."""
    return spawn(_loss_of, 1, (str(directory), x, y))[0]


def _loss_of(directory: str, x: torch.Tensor, y: torch.Tensor) -> float:
    transformers.logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return float(lm_loss(model(x).logits, y))
