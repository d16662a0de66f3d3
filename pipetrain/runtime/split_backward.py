"""A stage's backward in two parts (zero-bubble's ``I`` and ``W``): the gradient with respect to the
stage's inputs first, that of its weights later.

The autograd graph from the stage's outputs splits into the *input path* (the nodes from which a
received input is reached) and the rest, which leads to the weights only. :func:`input_backward`
puts a pre-hook on each input-path node with an edge off the path (a *split node*: a linear layer's
matrix product, which computes its input's and its weight's gradients), keeping the gradient the node
receives, and computes the inputs' gradient alone, keeping the graph. :meth:`WeightBackward.run`
later runs each split node again from its kept gradient, to the weights its edges off the path lead
to, adding their gradients into ``.grad`` as one backward would, and frees the graph. Every node runs
the arithmetic of one whole backward, so the two parts give its gradients.

A weight that several split nodes lead to (a weight used twice in the stage) would be reached again
through the input path from the first of them; then the weight part runs from the stage's outputs
instead (exact, at the cost of the input path's backward a second time).

A compiled stage (:mod:`pipetrain.runtime.compiled`) is one graph node whose backward computes every
gradient at once; running it again for the weights would cost a second whole backward. There
:func:`fused_backward` takes both parts at ``I`` and ``W`` only adds the kept weights' gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

Starts = list[GradientEdge] | list[torch.Tensor]


@dataclass
class WeightBackward:
    """The weight-gradient part: per group, where it starts (gradient edges or output tensors), the
    gradient each start carries, and the leaves (weights) it computes gradients for."""

    groups: list[tuple[Starts, list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)

    def run(self) -> None:
        """Add the weights' gradients into their ``.grad``; the graph is freed."""
        for starts, grads, weights in self.groups:
            torch.autograd.backward(starts, grads, inputs=weights)
        self.groups = []


def input_backward(roots: list[torch.Tensor], grads: list[torch.Tensor],
                   inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightBackward]:
    """The gradients of ``roots`` (seeded with ``grads``) with respect to the leaves ``inputs`` (None for
    one they do not reach), and the part that computes every other leaf's gradient later."""
    on_path = _input_path(roots, {id(t) for t in inputs})
    splits = [n for n in on_path if any(f is not None and f not in on_path for f, _ in n.next_functions)]
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [n.register_prehook(lambda g, n=n: kept.__setitem__(n, g)) for n in splits]
    reached = [t for t in inputs if t.requires_grad]
    try:
        found = torch.autograd.grad(roots, reached, grads, retain_graph=True, allow_unused=True) \
            if reached and on_path else ()
    finally:
        for h in handles:
            h.remove()
    by_id = dict(zip(map(id, reached), found))
    starts: list[tuple[Starts, list[torch.Tensor], list[Node]]] = [
        ([r], [g], [r.grad_fn] if r.grad_fn is not None else []) for r, g in zip(roots, grads)
        if r.grad_fn not in on_path and r.requires_grad]
    for node in splits:
        edges = [(GradientEdge(node, k), g) for k, g in enumerate(kept.get(node, ())) if g is not None]
        if edges:
            starts.append(([e for e, _ in edges], [g for _, g in edges],
                           [f for f, _ in node.next_functions if f is not None and f not in on_path]))
    groups = _weight_groups(starts)
    if groups is None:  # a weight several split nodes lead to: from the outputs, to every weight
        weights = [w for _, _, ws in _weight_groups(starts, shared=True) or [] for w in ws]
        groups = [(list(roots), list(grads), weights)] if weights else []
    return [by_id.get(id(t)) for t in inputs], WeightBackward(groups)


def fused_backward(roots: list[torch.Tensor], grads: list[torch.Tensor],
                   inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightBackward]:
    """As :func:`input_backward`, for a graph whose nodes compute their inputs' and weights' gradients
    together (a compiled stage): one backward takes every leaf's gradient now; the weight part only adds
    the weights' into their ``.grad`` (through autograd, so gradient hooks fire then, as in a backward)."""
    given = {id(t) for t in inputs}
    weights = [t for t in _leaves(roots) if id(t) not in given]
    reached = [t for t in inputs if t.requires_grad]
    if not reached:  # nothing to send back (the input stage): the whole backward waits for W, as uncompiled
        return [None] * len(inputs), WeightBackward([(list(roots), list(grads), weights)] if weights else [])
    found = torch.autograd.grad(roots, reached + weights, grads, allow_unused=True) if reached + weights else ()
    by_id = dict(zip(map(id, reached), found))
    kept = [(w, g) for w, g in zip(weights, found[len(reached):]) if g is not None]
    part = WeightBackward([([w for w, _ in kept], [g for _, g in kept], [w for w, _ in kept])] if kept else [])
    return [by_id.get(id(t)) for t in inputs], part


def _leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf requiring a gradient that ``roots`` reach (a root that is one included), in a fixed order."""
    out = {id(r): r for r in roots if r.requires_grad and r.grad_fn is None}
    seen: set[Node] = set()
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            out.setdefault(id(leaf), leaf)
        stack.extend(f for f, _ in node.next_functions if f is not None)
    return list(out.values())


def _input_path(roots: list[torch.Tensor], inputs: set[int]) -> dict[Node, None]:
    """The graph nodes from which a leaf in ``inputs`` (by ``id``) is reached, leaves first (a dict: in
    order, for the weight part to run in the same order every time)."""
    order: list[Node] = []  # every node after the nodes it leads to
    seen: set[Node] = set()
    stack = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack.extend((f, False) for f, _ in node.next_functions if f is not None and f not in seen)
    on_path: dict[Node, None] = {}
    for node in order:
        leaf = getattr(node, "variable", None)
        if (id(leaf) in inputs) if leaf is not None else any(f in on_path for f, _ in node.next_functions):
            on_path[node] = None
    return on_path


def _weight_groups(starts: list[tuple[Starts, list[torch.Tensor], list[Node]]], shared: bool = False
                   ) -> list[tuple[Starts, list[torch.Tensor], list[torch.Tensor]]] | None:
    """Each start with the leaves its nodes off the input path lead to; None when two starts share a
    node (a weight reached from two split nodes), unless ``shared``, which then groups what each
    reaches first."""
    owner: dict[Node, int] = {}
    groups = []
    for i, (edges, grads, first) in enumerate(starts):
        leaves = [e for e in edges if isinstance(e, torch.Tensor) and e.grad_fn is None]  # an output that is a leaf
        stack = list(first)
        while stack:
            node = stack.pop()
            if node in owner:
                if owner[node] != i and not shared:
                    return None
                continue
            owner[node] = i
            leaf = getattr(node, "variable", None)
            if leaf is not None:
                leaves.append(leaf)
            stack.extend(f for f, _ in node.next_functions if f is not None)
        if leaves:
            groups.append((edges, grads, leaves))
    return groups
