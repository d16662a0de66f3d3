"""torch.distributed.pipelining's own recipe for a model bigger than one worker, as torchtitan splits
a Llama by hand: every rank builds the whole model on the meta device, deletes what other ranks hold,
gives the rest memory (``to_empty``), reads its own tensors from the checkpoint, recomputes what meta
construction left without values, and runs ``Schedule1F1B`` with SGD.
"""
from __future__ import annotations

import json
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import LlamaConfig, LlamaForCausalLM

from bigmodel.model import lm_loss, meta_model, trained_then_probe
from pipetrain.runtime.launch import spawn
from pipetrain.weightfiles import INDEX


class Piece(nn.Module):
    """One rank's decoder layers of a ``LlamaForCausalLM`` (the first rank's with the embedding, the last
    rank's with the final norm and head), each module under the model's own name so that the
    checkpoint's keys load as they are; what other ranks hold is deleted (set to ``None``).
    ``PipelineStage`` calls it with one tensor (token ids on the first rank, hidden states after) and
    sends on the one it returns: the model's own forward starts from token ids, so it cannot run a
    piece of the stack.
    """

    def __init__(self, model: LlamaForCausalLM, layers: range, last: bool) -> None:
        super().__init__()
        inner = model.model
        inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layers})  # a dict keeps their names
        if layers.start > 0:
            inner.embed_tokens = None
        if not last:
            inner.norm = None
        self.model, self.lm_head = inner, model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model
        h = x if inner.embed_tokens is None else inner.embed_tokens(x)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = inner.rotary_emb(h, positions)
        for layer in inner.layers.values():
            # no mask: attention is then causal, as the whole model's is without padding
            h = layer(h, position_embeddings=rotary, position_ids=positions)
        return h if self.lm_head is None else self.lm_head(inner.norm(h))


def load_own(piece: nn.Module, checkpoint: Path) -> None:
    """Copy ``piece``'s tensors from the checkpoint's shards, opening only the shards that hold them."""
    where = json.loads((checkpoint / INDEX).read_text())["weight_map"]
    mine = piece.state_dict()
    by_file: dict[str, list[str]] = defaultdict(list)
    for key in mine:
        by_file[where[key]].append(key)
    for file, keys in by_file.items():
        with safe_open(checkpoint / file, framework="pt") as f:
            for key in keys:
                mine[key].copy_(f.get_tensor(key))


def recompute_rotary(piece: Piece, config: LlamaConfig) -> None:
    """The rotary embedding's ``inv_freq`` is a buffer computed in ``__init__``, not saved: built on the
    meta device it has no values, and ``to_empty`` leaves it uninitialized memory."""
    rotary = piece.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(config)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)


def torch_rank(checkpoint: str, x: torch.Tensor, y: torch.Tensor, batch: int, microbatches: int, lr: float,
               threads: int) -> dict[str, Any]:
    """One rank of the job: build its piece, then one ``Schedule1F1B`` step and one SGD step per
    minibatch of ``x``, ``y`` in order, the last at learning rate 0 as in pipetrain's job. Returns its
    ``ready`` and per-step ``times`` (``perf_counter``), ``losses`` (the last rank's, per step) and
    ``peak_memory`` (bytes)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # imports torch._dynamo: seconds

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig.from_pretrained(checkpoint)
    per, last = config.num_hidden_layers // world, rank == world - 1
    piece = Piece(meta_model(config), range(rank * per, (rank + 1) * per), last)
    piece.to_empty(device="cpu")
    with torch.no_grad():
        load_own(piece, Path(checkpoint))
        recompute_rotary(piece, config)
    mb, seq, width = batch // microbatches, x.shape[1], config.hidden_size
    # shapes only: PipelineStage makes its receive buffers from them; requires_grad says a gradient
    # crosses the cut ([Note: static stage metadata] in pipetrain.bench.torch_peers)
    hidden = torch.empty(mb, seq, width, device="meta", requires_grad=True)
    inputs = torch.empty(mb, seq, dtype=torch.long, device="meta") if rank == 0 else hidden
    logits = torch.empty(mb, seq, config.vocab_size, device="meta", requires_grad=True)
    outputs = logits if last else hidden
    stage = PipelineStage(piece, rank, world, torch.device("cpu"), input_args=(inputs,), output_args=(outputs,))
    schedule = Schedule1F1B(stage, microbatches, loss_fn=lm_loss)  # on every rank: without, forward only
    opt = torch.optim.SGD(piece.parameters(), lr=lr)
    steps = len(x) // batch
    scheduler = LambdaLR(opt, trained_then_probe(steps))
    ready = time.perf_counter()
    times, losses = [], []
    for t in range(steps):
        xs, ys = x[t * batch:(t + 1) * batch], y[t * batch:(t + 1) * batch]
        opt.zero_grad()
        found: list[torch.Tensor] = []
        schedule.step(*((xs,) if rank == 0 else ()), **({"target": ys, "losses": found} if last else {}),
                      return_outputs=False)
        opt.step()
        scheduler.step()
        times.append(time.perf_counter())
        if found:
            losses.append(float(torch.stack(found).detach().mean()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "ready": ready, "times": times, "losses": losses, "peak_memory": peak}


def run_torch(checkpoint: Path, x: torch.Tensor, y: torch.Tensor, batch: int, microbatches: int, lr: float,
              threads: int, ranks: int = 4) -> dict[str, Any]:
    """The job on ``ranks`` local processes, started as pipetrain starts its workers (so both pay the same
    start), and its ranks' results with ``launched``, the ``perf_counter`` before they started."""
    launched = time.perf_counter()
    results = spawn(torch_rank, ranks, (str(checkpoint), x, y, batch, microbatches, lr, threads))
    return {"launched": launched, "ranks": results}
