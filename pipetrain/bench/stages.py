"""A zoo model cut into pipeline stages as pipetrain cuts it, each called as ``stage(*tensors)``, and
each stage's compute timed alone (the bound a pipeline's slowest stage sets)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.bench.measure import PeerConfig
from pipetrain.layers import LayeredModel, received
from pipetrain.timing import median_seconds, torch_threads


class Splat(nn.Module):
    """A stage called as ``stage(*tensors)`` (PipelineStage's convention) around one taking one value or,
    if ``takes_tuple`` (:meth:`pipetrain.layers.LayeredModel.takes_tuple`), a tuple, even of one tensor."""

    def __init__(self, inner: nn.Module, takes_tuple: bool) -> None:
        super().__init__()
        self.inner, self.takes_tuple = inner, takes_tuple

    def forward(self, *xs: torch.Tensor) -> Any:
        out = self.inner(xs if self.takes_tuple or len(xs) > 1 else xs[0])
        # torch's p2p sends need contiguous tensors; a stage may end in a view (a transpose, say).
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()


def as_tuple(v: Any) -> tuple[torch.Tensor, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def cut(layers: LayeredModel, boundaries: Sequence[int]) -> list[Splat]:
    """The stages starting at layers ``boundaries``, each called as ``stage(*tensors)``."""
    bounds = [int(b) for b in boundaries]
    return [Splat(s, layers.takes_tuple(b)) for s, b in zip(layers.stages(bounds), bounds)]


def stage_times(peer: PeerConfig, boundaries: Sequence[int], repeats: int = 10, warmup: int = 2) -> list[dict[str, Any]]:
    """Each stage's compute measured alone, in this process with ``peer.threads`` threads.

    Per stage, medians of ``repeats`` runs after ``warmup``: ``forward_backward_s`` (its layers' forward
    and backward at the batch size, with the loss on the last stage, input gradients on the others, as
    in a pipeline); ``update_s`` (an SGD step over its parameters); ``weight_copy_s`` (cloning its
    parameters once, what a weight stash or a gradient hand-over costs).
    """
    with torch_threads(peer.threads):
        model = peer.build()
        bounds = [int(b) for b in boundaries]
        layers = LayeredModel(model)
        pieces = cut(layers, bounds)
        x, y = peer.spec.dataset(peer.batch_size, seed=peer.seed + 1)[:]
        ends = [*bounds[1:], len(layers)]
        out, value = [], as_tuple(x)
        for s, piece in enumerate(pieces):
            last = s == len(pieces) - 1
            params = [p for p in piece.parameters() if p.requires_grad]
            with torch.no_grad():
                seeds = None if last else [torch.ones_like(o) for o in as_tuple(piece(*received(list(value), False)[1]))
                                           if o.is_floating_point()]

            def forward_backward() -> None:
                for p in params:
                    p.grad = None
                result = piece(*received(list(value), s > 0)[1])
                if last:
                    peer.spec.loss_fn(result, y).backward()
                else:
                    outs = [o for o in as_tuple(result) if o.is_floating_point()]
                    torch.autograd.backward(outs, seeds)

            opt = torch.optim.SGD(params, lr=peer.lr) if params else None
            row = {"layers": [bounds[s], ends[s] - 1], "params": sum(p.numel() for p in params),
                   "forward_backward_s": median_seconds(forward_backward, repeats, warmup),
                   "update_s": median_seconds(opt.step, repeats, warmup) if opt else 0.0,
                   "weight_copy_s": median_seconds(lambda: [p.detach().clone() for p in params], repeats, warmup)}
            out.append(row)
            with torch.no_grad():
                value = as_tuple(piece(*value))
        return out
