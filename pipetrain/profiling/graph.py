"""Reading PipeDream's published profiles (``graph.txt``; the format is in ``pipetrain/data/pipedream``).

A graph's node lines give each node's measured times and sizes; its edge lines, which nodes feed which.
:func:`read_graph` orders the layer nodes and finds the bytes crossing the cut after each;
:meth:`pipetrain.profiling.Profile.from_pipedream` makes a profile of them.
"""
from __future__ import annotations

import heapq
import itertools
import math
import re
from dataclasses import dataclass


class GraphError(ValueError):
    """A graph.txt that cannot be read: one line naming the file (and the line) and the fix."""


@dataclass(frozen=True)
class Node:
    """One node line: times in milliseconds, sizes in bytes."""

    name: str
    desc: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    parameter_bytes: int


@dataclass(frozen=True)
class Graph:
    """The layer nodes of a graph in order, ``cut_bytes[k]`` the bytes crossing the cut after
    ``layers[k]``, and ``input_bytes`` those of its ``Input`` nodes (the model input)."""

    layers: list[Node]
    cut_bytes: list[int]
    input_bytes: int


def read_graph(source: str, text: str) -> Graph:
    """The graph ``text`` (the contents of the graph.txt ``source``) holds.

    Layers are the graph's nodes in topological order, ties broken by node number; ``Input``
    nodes are the model input, not layers. The bytes crossing the cut after a layer are those of
    every node at or before it with an edge to a node after it (both branches inside a residual
    block); after the last layer, its own output.

    Raises:
        GraphError: a malformed file (one line naming it, the line and the fix), edges that form a
            cycle, or several nodes but no edges (the boundary costs would all be zero).
    """
    nodes, edges = _parse(source, text)
    order = _topological(source, nodes, edges)
    inputs = [v for v in order if nodes[v].desc.startswith("Input")]
    order = [v for v in order if not nodes[v].desc.startswith("Input")]
    pos = {v: k for k, v in enumerate(order)} | {v: -1 for v in inputs}
    # A node's output crosses every cut from its own position up to its last consumer's.
    crossing = [0] * (len(order) + 1)
    for v, consumers in edges.items():
        last = max(pos[u] for u in consumers)
        if last > pos[v]:
            crossing[pos[v] + 1] += nodes[v].activation_bytes
            crossing[last + 1] -= nodes[v].activation_bytes
    cut = list(itertools.accumulate(crossing))[1:]  # cut[k]: after position k
    cut[-1] = nodes[order[-1]].activation_bytes
    return Graph([nodes[v] for v in order], cut, sum(nodes[v].activation_bytes for v in inputs))


_NODE_LINE = re.compile(r"^(\S+) -- (.*) -- (forward_compute_time=.*)$")
_FIELD = re.compile(r"(\w+)=(\[[^\]]*\]|[^,]+)")
_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_GRAPH_FIX = ("expected `nodeN -- Desc -- forward_compute_time=MS, backward_compute_time=MS, "
              "activation_size=BYTES, parameter_size=BYTES` or a tab and `nodeA -- nodeB`")


def _parse(source: str, text: str) -> tuple[dict[str, Node], dict[str, list[str]]]:
    """Nodes by name and, per node, the nodes it feeds, from graph.txt text."""
    nodes: dict[str, Node] = {}
    node_line: dict[str, int] = {}
    edges: dict[str, list[str]] = {}
    edge_lines: list[tuple[int, str, str]] = []
    lines = text.rstrip().splitlines()

    def cut(lineno: int) -> str:
        """A hint on the last line: a file cut short ends in a partial line."""
        return " (the last line: truncated?)" if lineno == len(lines) > 1 else ""

    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.startswith("\t"):
            ends = line.strip().split(" -- ")
            if len(ends) != 2:
                raise GraphError(f"{source}:{lineno}: cannot read edge line {line.strip()!r}{cut(lineno)}; "
                                 f"{_GRAPH_FIX}")
            edge_lines.append((lineno, ends[0], ends[1]))
            continue
        m = _NODE_LINE.match(line.strip())
        fields = dict(_FIELD.findall(m.group(3))) if m else {}
        try:
            values = {k: _number(fields[k]) for k in _FIELDS}
        except (KeyError, ValueError):
            raise GraphError(f"{source}:{lineno}: cannot read node line {line.strip()[:60]!r}{cut(lineno)}; "
                             f"{_GRAPH_FIX}") from None
        node = m.group(1)  # type: ignore[union-attr]
        bad = next((k for k, v in values.items() if not (math.isfinite(v) and v >= 0)), None)
        if bad:
            raise GraphError(f"{source}:{lineno}: node {node} has {bad}={fields[bad].strip()}; times and sizes "
                             "must be finite and >= 0")
        if node in node_line:
            raise GraphError(f"{source}:{lineno}: node {node} again (first at line {node_line[node]}); "
                             "give each node one node line")
        node_line[node] = lineno
        forward, backward, act, par = values.values()
        nodes[node] = Node(node, m.group(2), forward, backward, round(act), round(par))  # type: ignore[union-attr]
    for lineno, a, b in edge_lines:
        if a not in nodes or b not in nodes:
            raise GraphError(f"{source}:{lineno}: edge {a} -- {b} names a node with no node line{cut(lineno)}; "
                             "add the node line or drop the edge")
        edges.setdefault(a, []).append(b)
    layers = [n for n in nodes.values() if not n.desc.startswith("Input")]
    if not layers:
        raise GraphError(f"{source}: no layer nodes found; give a PipeDream graph.txt ({_GRAPH_FIX})")
    if not any(n.forward_ms + n.backward_ms for n in layers):
        raise GraphError(f"{source}: every layer node takes 0 ms, so any throughput would be infinite; "
                         "give a graph.txt with measured times")
    if len(nodes) > 1 and not edges:
        raise GraphError(f"{source}: has {len(nodes)} nodes but no edges: the boundary costs would all be zero; "
                         "give the whole graph.txt, whose edge lines (a tab, then `nodeA -- nodeB`) follow "
                         "the node lines")
    return nodes, edges


def _number(text: str) -> float:
    """``12.5`` or a list ``[a; b; ...]`` (several outputs), summed."""
    text = text.strip()
    if text.startswith("["):
        if not text.endswith("]"):
            raise ValueError(f"{text!r} has no closing ']'")
        return sum(float(x) for x in text[1:-1].split(";") if x.strip())
    return float(text)


def _topological(source: str, nodes: dict[str, Node], edges: dict[str, list[str]]) -> list[str]:
    """Kahn's algorithm; among ready nodes the lowest node number goes first, so the order is
    deterministic and follows the file's numbering where the graph allows."""
    indegree = dict.fromkeys(nodes, 0)
    for consumers in edges.values():
        for u in consumers:
            indegree[u] += 1
    ready = [(_natural(v), v) for v, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, v = heapq.heappop(ready)
        order.append(v)
        for u in edges.get(v, []):
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, (_natural(u), u))
    if len(order) < len(nodes):
        stuck = sorted((v for v in nodes if v not in set(order)), key=_natural)[:3]
        raise GraphError(f"{source}: the edges form a cycle through {', '.join(stuck)}; "
                         "a profile graph must be acyclic")
    return order


def _natural(name: str) -> tuple[str | int, ...]:
    """``node10`` sorts after ``node9``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
