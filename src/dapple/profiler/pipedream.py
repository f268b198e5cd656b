"""Import PipeDream profiles (``graph.txt``) as a :class:`ModelProfile` layer chain.

Pure, no torch. PipeDream's profiler writes one line per node and one tab-indented line per
edge::

    node4 -- Embedding(32320, 1024) -- forward_compute_time=0.073, backward_compute_time=6.949, activation_size=6291456.0, parameter_size=132382720.000
    \tnode1 -- node4

Times are milliseconds and sizes bytes, both for PipeDream's profiling batch of ``B`` samples
(``activation_size`` may be a list ``[a; b; c]`` for a node with several outputs; an optional
``-- stage_id=N`` tail is ignored). Real graphs are DAGs (side nodes such as ``Size``/``View``,
residual branches, several inputs), so the nodes are linearised in a deterministic topological
order that keeps the file's node order wherever the edges leave it free. A cut after position
``k`` carries every tensor produced at or before ``k`` and consumed after it, so layer ``k``'s
``output_bytes_per_sample`` is that sum (for the last layer: its own output). A node's
``kept_activation_bytes_per_sample`` is its own output (PipeDream stashes node outputs); times
are per sample (``t / B``, no fixed part) and parameter bytes are taken as they are.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass
from pathlib import Path

from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.files.text_file import read_text_file

__all__ = [
    "PipeDreamGraph",
    "PipeDreamNode",
    "cut_bytes",
    "import_pipedream",
    "linearise",
    "parse_graph",
]

_NODE_RE = re.compile(
    r"^(?P<id>\S+) -- (?P<desc>.*?) -- (?P<metrics>forward_compute_time=.*?)"
    r"(?: -- stage_id=(?P<stage>-?\d+))?\s*$"
)
_EDGE_RE = re.compile(r"^\t(?P<src>\S+) -- (?P<dst>\S+)\s*$")
_METRICS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


@dataclass(frozen=True, slots=True)
class PipeDreamNode:
    """One node of a PipeDream graph (values for the whole profiling batch)."""

    node_id: str
    description: str
    forward_ms: float
    backward_ms: float
    activation_bytes: float
    """Sum of the node's output sizes."""
    parameter_bytes: float
    stage_id: int | None
    line: int
    """1-based line number in the file."""


@dataclass(frozen=True, slots=True)
class PipeDreamGraph:
    """Nodes in file order and edges ``(producer, consumer)``."""

    nodes: tuple[PipeDreamNode, ...]
    edges: tuple[tuple[str, str], ...]


def _number(text: str, where: str) -> float:
    try:
        v = float(text)
    except ValueError as e:
        raise ValidationError(f"{where}: {text!r} is not a number") from e
    if not math.isfinite(v) or v < 0:
        raise ValidationError(f"{where}: {text!r} must be a finite number >= 0")
    return v


def _value(text: str, where: str) -> float:
    text = text.strip()
    if text.startswith("["):
        if not text.endswith("]"):
            raise ValidationError(f"{where}: unterminated list {text!r}")
        items = [s for s in text[1:-1].split(";") if s.strip()]
        return sum(_number(s.strip(), where) for s in items)
    return _number(text, where)


def _parse_node(line: str, where: str, lineno: int) -> PipeDreamNode:
    m = _NODE_RE.match(line)
    if m is None:
        raise ValidationError(
            f"{where}: not a node line 'ID -- DESCRIPTION -- forward_compute_time=..., ...' "
            f"nor a tab-indented edge 'SRC -- DST': {line[:80]!r}"
        )
    metrics: dict[str, float] = {}
    for part in m["metrics"].split(","):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep:
            raise ValidationError(f"{where}: expected key=value, got {part.strip()!r}")
        if key in _METRICS:
            metrics[key] = _value(val, f"{where}: {key}")
    missing = [k for k in _METRICS if k not in metrics]
    if missing:
        raise ValidationError(f"{where}: node {m['id']!r} lacks {', '.join(missing)}")
    return PipeDreamNode(
        node_id=m["id"],
        description=m["desc"].strip(),
        forward_ms=metrics["forward_compute_time"],
        backward_ms=metrics["backward_compute_time"],
        activation_bytes=metrics["activation_size"],
        parameter_bytes=metrics["parameter_size"],
        stage_id=int(m["stage"]) if m["stage"] is not None else None,
        line=lineno,
    )


def parse_graph(text: str, source: str = "graph.txt") -> PipeDreamGraph:
    """Parse the text of a PipeDream ``graph.txt``.

    Args:
        text: file contents.
        source: file name used in error messages.

    Raises:
        ValidationError: a malformed line, duplicate node or edge to an unknown node (the
            message names the line number).
    """
    nodes: list[PipeDreamNode] = []
    ids: dict[str, int] = {}
    edges: list[tuple[str, str, int]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        if line.startswith("\t"):
            m = _EDGE_RE.match(line)
            if m is None:
                raise ValidationError(f"{where}: malformed edge line {line.strip()[:80]!r}")
            edges.append((m["src"], m["dst"], lineno))
            continue
        node = _parse_node(line, where, lineno)
        if node.node_id in ids:
            raise ValidationError(
                f"{where}: duplicate node {node.node_id!r} (first on line {nodes[ids[node.node_id]].line})"
            )
        ids[node.node_id] = len(nodes)
        nodes.append(node)
    if not nodes:
        raise ValidationError(f"{source}: no nodes found")
    for src, dst, lineno in edges:
        for n in (src, dst):
            if n not in ids:
                raise ValidationError(f"{source}:{lineno}: edge names unknown node {n!r}")
    unique = tuple(dict.fromkeys((s, d) for s, d, _ in edges))
    return PipeDreamGraph(nodes=tuple(nodes), edges=unique)


def linearise(graph: PipeDreamGraph) -> list[PipeDreamNode]:
    """Topological order of the nodes, preferring file order among ready nodes (Kahn).

    Raises:
        ValidationError: the graph has a cycle (the message names the nodes on it).
    """
    index = {n.node_id: i for i, n in enumerate(graph.nodes)}
    succ: dict[str, list[str]] = {n.node_id: [] for n in graph.nodes}
    indeg = dict.fromkeys(index, 0)
    for s, d in graph.edges:
        succ[s].append(d)
        indeg[d] += 1
    ready = [index[n] for n, k in indeg.items() if k == 0]
    heapq.heapify(ready)
    order: list[PipeDreamNode] = []
    while ready:
        node = graph.nodes[heapq.heappop(ready)]
        order.append(node)
        for d in succ[node.node_id]:
            indeg[d] -= 1
            if indeg[d] == 0:
                heapq.heappush(ready, index[d])
    if len(order) < len(graph.nodes):
        raise ValidationError(
            f"PipeDream graph has a cycle through {', '.join(_cycle(graph, indeg))}"
        )
    return order


def _cycle(graph: PipeDreamGraph, indeg: dict[str, int]) -> list[str]:
    """One cycle among the nodes Kahn's algorithm could not order."""
    left = {n for n, k in indeg.items() if k > 0}
    pred = {n: [s for s, d in graph.edges if d == n and s in left] for n in left}
    file_pos = {x.node_id: i for i, x in enumerate(graph.nodes)}
    node = min(left, key=file_pos.__getitem__)
    path: list[str] = []
    while node not in path:  # every remaining node has a remaining predecessor
        path.append(node)
        node = pred[node][0]
    cycle = path[path.index(node) :]
    cycle.reverse()  # walked backwards along the edges
    start = min(range(len(cycle)), key=lambda i: file_pos[cycle[i]])
    cycle = cycle[start:] + cycle[:start]
    return [*cycle, cycle[0]]


def cut_bytes(order: list[PipeDreamNode], edges: tuple[tuple[str, str], ...]) -> list[float]:
    """Bytes crossing the cut after each position of ``order`` (whole profiling batch).

    ``result[k]`` sums the activation of every node at position ``<= k`` with a consumer at
    position ``> k``; the last entry is the last node's own output.
    """
    pos = {n.node_id: i for i, n in enumerate(order)}
    last_use = {n.node_id: -1 for n in order}
    for s, d in edges:
        last_use[s] = max(last_use[s], pos[d])
    delta = [0.0] * (len(order) + 1)
    for n in order:
        p, q = pos[n.node_id], last_use[n.node_id]
        if q > p:  # live on the cuts p .. q-1
            delta[p] += n.activation_bytes
            delta[q] -= n.activation_bytes
    out, live = [], 0.0
    for k in range(len(order)):
        live += delta[k]
        out.append(live)
    out[-1] = order[-1].activation_bytes
    return out


def import_pipedream(
    path: str | Path, batch_size: int = 1, model_name: str | None = None
) -> ModelProfile:
    """Read a PipeDream ``graph.txt`` into a per-sample :class:`ModelProfile`.

    Args:
        path: the graph file.
        batch_size: PipeDream's profiling batch size ``B`` (times and activations are divided
            by it).
        model_name: profile name (default: the file's parent folder or stem).

    Raises:
        ValidationError: unreadable file, malformed line (with its number), cycle, bad batch.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValidationError(f"--batch-size must be a positive integer, got {batch_size!r}")
    p = Path(path)
    text = read_text_file(p, "PipeDream graph")
    graph = parse_graph(text, str(p))
    order = linearise(graph)
    crossing = cut_bytes(order, graph.edges)
    has_pred = {d for _, d in graph.edges}
    input_bytes = sum(
        n.activation_bytes
        for n in order
        if n.node_id not in has_pred and n.description.lower().startswith("input")
    )
    b = float(batch_size)
    layers = tuple(
        LayerProfile(
            name=f"{n.node_id} {n.description}"[:120],
            forward=AffineTime(fixed_ms=0.0, per_sample_ms=n.forward_ms / b),
            backward=AffineTime(fixed_ms=0.0, per_sample_ms=n.backward_ms / b),
            output_bytes_per_sample=crossing[i] / b,
            parameter_bytes=round(n.parameter_bytes),
            kept_activation_bytes_per_sample=n.activation_bytes / b,
        )
        for i, n in enumerate(order)
    )
    name = model_name or (p.parent.name if p.stem == "graph" and p.parent.name else p.stem)
    return ModelProfile(
        model_name=name,
        layers=layers,
        input_bytes_per_sample=input_bytes / b,
        device="PipeDream profile",
        batch_sizes=(batch_size,),
    )
