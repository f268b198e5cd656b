"""The passes that decide how an exported graph's nodes fall into pieces, each on its own.

Used by :class:`dapple.models.split_graph.SplitModel`: a cut is a position in the graph's node
list; :func:`layout_pieces` runs the passes in order and returns a :class:`PieceLayout` - which
piece computes each node and which values cross each cut - from which the pieces' graphs are
built. Pieces are numbered ``k = 0 .. num - 1``; ``num`` stands for the model's output.

1. :func:`assign_pieces`: each compute node to the piece of its position;
2. :func:`merge_empty_pieces`: pieces that compute no tensor into their neighbour;
3. :func:`last_uses`: the last piece that reads each value;
4. :func:`batch_dependent`: the values computed from the inputs' values (the others are
   recomputed by each piece that needs them instead of crossing a cut);
5. :func:`live_values`: the tensors that cross each cut, all batch-major (checked).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from dapple.errors import ValidationError

__all__ = [
    "PieceLayout",
    "assign_pieces",
    "batch_dependent",
    "batch_free",
    "batch_symbols",
    "last_uses",
    "layout_pieces",
    "live_values",
    "merge_empty_pieces",
]

_SYM_SIZE = torch.ops.aten.sym_size.int


def batch_symbols(placeholders: list[fx.Node]) -> set[Any]:
    """The symbolic batch sizes of the traced inputs (dimension 0 of each tensor input)."""
    syms: set[Any] = set()
    for ph in placeholders:
        val = ph.meta.get("val")
        if (
            isinstance(val, torch.Tensor)
            and val.dim() > 0
            and isinstance(val.shape[0], torch.SymInt)
        ):
            syms.add(val.shape[0].node.expr)
    return syms


def _is_tensor(v: fx.Node) -> bool:
    return isinstance(v.meta.get("val"), torch.Tensor)


def assign_pieces(
    nodes: list[fx.Node], cuts: list[tuple[int, str]]
) -> tuple[dict[fx.Node, int], list[str]]:
    """Pass 1: each compute node to the piece of its position (piece ``k > 0`` starts at
    ``cuts[k - 1]``; piece 0 is the ``prologue``); a ``getitem`` on a list-valued node stays
    with that node (lists never cross a cut).

    Args:
        nodes: the graph's nodes, in order.
        cuts: ``(position, name)`` of each cut, by position.

    Returns:
        The piece of each ``call_function`` node, and each piece's name.
    """
    bounds = [0, *[p for p, _ in cuts], len(nodes)]
    names = ["prologue", *[n for _, n in cuts]]
    piece_of: dict[fx.Node, int] = {}
    for pos, node in enumerate(nodes):
        if node.op == "call_function":
            piece_of[node] = max(k for k in range(len(names)) if bounds[k] <= pos)
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if isinstance(src, fx.Node) and src in piece_of:
                piece_of[node] = piece_of[src]
    return piece_of, names


def merge_empty_pieces(
    piece_of: dict[fx.Node, int], names: list[str]
) -> tuple[dict[fx.Node, int], list[str]]:
    """Pass 2: a piece that computes no tensor (nothing, or only sizes and checks, runs before
    the first block) joins the next piece that does, or the last such piece; pieces renumbered.

    Raises:
        ValidationError: no piece computes a tensor.
    """
    used = sorted({k for n, k in piece_of.items() if _is_tensor(n)})
    if not used:
        raise ValidationError("the model computes no tensor")
    renumber = {
        old: next((new for new, k in enumerate(used) if k >= old), len(used) - 1)
        for old in set(piece_of.values())
    }
    return {n: renumber[k] for n, k in piece_of.items()}, [names[k] for k in used]


def last_uses(
    nodes: list[fx.Node], piece_of: dict[fx.Node, int], final: list[fx.Node], num: int
) -> dict[fx.Node, int]:
    """Pass 3: the last piece that reads each value (``num`` for the model's outputs)."""
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            last_use[arg] = max(last_use.get(arg, -1), piece_of[node])
    for arg in final:
        last_use[arg] = num
    return last_use


def batch_dependent(nodes: list[fx.Node], placeholders: list[fx.Node]) -> set[fx.Node]:
    """Pass 4: the inputs and every node computed from their values (reading only a size,
    ``aten.sym_size``, does not count: a piece re-reads it from its own inputs)."""
    dep = set(placeholders)
    for node in nodes:
        if (
            node.op == "call_function"
            and node.target is not _SYM_SIZE
            and any(a in dep for a in node.all_input_nodes)
        ):
            dep.add(node)
    return dep


def batch_free(nodes: list[fx.Node], dep: set[fx.Node]) -> set[fx.Node]:
    """The compute nodes outside ``dep`` (tables built from buffers, causal masks, rotary
    tables of the inputs' length): each piece that needs one recomputes it."""
    return {
        n for n in nodes if n.op == "call_function" and n not in dep and n.target is not _SYM_SIZE
    }


def _folds_batch(v: fx.Node, name: str, batch_syms: set[Any]) -> bool:
    """Whether ``v``, crossing the cut before piece ``name``, is batch x factor in dimension 0
    (sample-major: it crosses as ``(batch, factor, ...)``); False when it is batch-major.

    Raises:
        ValidationError: its dimension 0 is not the batch.
    """
    dim0 = v.meta["val"].shape[0] if v.meta["val"].dim() else None
    expr = dim0.node.expr if isinstance(dim0, torch.SymInt) else None
    if expr is not None and expr not in batch_syms and expr.free_symbols & batch_syms:
        return True
    if expr not in batch_syms:
        raise ValidationError(
            f"the cut before {name!r} would carry {v.name} of shape "
            f"{tuple(v.meta['val'].shape)} whose dimension 0 is not the batch; "
            "choose other split_at names"
        )
    return False


def live_values(
    nodes: list[fx.Node],
    piece_of: dict[fx.Node, int],
    last_use: dict[fx.Node, int],
    dep: set[fx.Node],
    names: list[str],
) -> tuple[list[list[fx.Node]], set[fx.Node]]:
    """Pass 5: the batch-dependent tensors that cross the cut before each piece ``k >= 1``
    (defined before it, read in or after it), checked to carry the batch in dimension 0.

    Returns:
        The crossing values of each cut (index ``k - 1``), and those whose dimension 0 is batch x
        factor (they cross as ``(batch, factor, ...)``).

    Raises:
        ValidationError: a crossing value's dimension 0 is not the batch.
    """
    placeholders = [n for n in nodes if n.op == "placeholder"]
    batch_syms = batch_symbols(placeholders)

    def defined_in(v: fx.Node) -> int:
        return -1 if v.op == "placeholder" else piece_of.get(v, -2)

    values = [
        v for v in nodes if v.op in ("placeholder", "call_function") and _is_tensor(v) and v in dep
    ]
    crossing: list[list[fx.Node]] = []
    folded: set[fx.Node] = set()
    for k in range(1, len(names)):
        live = [
            v for v in values if defined_in(v) < k <= last_use.get(v, -1) and defined_in(v) > -2
        ]
        folded.update(v for v in live if _folds_batch(v, names[k], batch_syms))
        crossing.append(live)
    return crossing, folded


@dataclass(frozen=True)
class PieceLayout:
    """How a graph's nodes fall into pieces: the result of the passes."""

    piece_of: dict[fx.Node, int]
    """The piece that computes each compute node (batch-free nodes: where they first ran)."""
    names: list[str]
    """Each piece's name: ``prologue`` or the module name it starts at."""
    live_in: list[list[fx.Node]]
    """The values piece ``k`` takes (``live_in[0]``: the graph's inputs) and, last, the
    model's outputs: piece ``k`` returns ``live_in[k + 1]``."""
    folded: set[fx.Node]
    """Crossing values whose dimension 0 is batch x factor (cross as ``(batch, factor, ...)``)."""
    batch_free: set[fx.Node]
    """Compute nodes that do not depend on the inputs' values: recomputed, never passed."""

    @property
    def num(self) -> int:
        return len(self.names)

    def body(self, nodes: list[fx.Node], k: int) -> list[fx.Node]:
        """The nodes piece ``k`` computes, in graph order."""
        return [n for n in nodes if self.piece_of.get(n) == k]


def layout_pieces(nodes: list[fx.Node], cuts: list[tuple[int, str]]) -> PieceLayout:
    """Run the passes over an exported graph's ``nodes`` cut at ``cuts``.

    Raises:
        ValidationError: the model computes no tensor, a cut would carry a value whose
            dimension 0 is not the batch, or a model output is not a tensor.
    """
    piece_of, names = merge_empty_pieces(*assign_pieces(nodes, cuts))
    placeholders = [n for n in nodes if n.op == "placeholder"]
    final = list(next(n for n in nodes if n.op == "output").all_input_nodes)
    last_use = last_uses(nodes, piece_of, final, len(names))
    dep = batch_dependent(nodes, placeholders)
    free = batch_free(nodes, dep)
    crossing, folded = live_values(nodes, piece_of, last_use, dep, names)
    for v in final:
        if not _is_tensor(v):
            raise ValidationError(f"model output {v.name} is not a tensor")
    return PieceLayout(piece_of, names, [placeholders, *crossing, final], folded, free)
