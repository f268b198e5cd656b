"""Where a traced piece computes its experts, and how it is cut for expert parallelism.

A traced Hugging Face sparse-MoE block (Mixtral, Qwen2-MoE: ``transformers``' grouped-matmul
experts, fused 3-d weights ``[E, ...]``) computes its experts as a *site*: grouped matmuls
(``transformers.grouped_mm_fallback`` or ``aten._grouped_mm``) that share one offsets node
(the cumulative rows per expert), the first taking the token rows sorted by expert, the last
giving their results in that order, and only row-wise operations (chunk, activation,
products, casts) in between. :func:`find_sites` finds them; :func:`shard_site` cuts one: the
weights keep their names and become this member's ``E/e`` experts, :class:`ExpertDispatch`
goes before the first matmul and :class:`ExpertCombine` after the last. The router, the
sorting and the weighting by the router's scores stay as they are, on this replica's tokens.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import fx, nn

from dapple.errors import ValidationError
from dapple.runtime.parallel.expert.exchange import Collectives, ExpertCombine, ExpertDispatch

__all__ = ["ExpertSite", "find_sites", "shard_site", "site_experts"]

_ROW_WISE = frozenset(
    {
        "chunk", "split", "mul", "add", "sub", "div", "silu", "gelu", "relu", "sigmoid",
        "tanh", "to", "_to_copy", "clone", "contiguous", "neg", "clamp", "pow",
    }
)  # fmt: skip
"""aten ops allowed between a site's first and last matmul: each output row depends only on
the same row of its inputs, so they run unchanged on the rows of this member's experts."""


@dataclass(frozen=True)
class ExpertSite:
    """One MoE layer's experts in a traced piece."""

    offs: fx.Node
    """The cumulative rows per expert (``[E]``)."""
    matmuls: tuple[fx.Node, ...]
    """The grouped matmuls, in graph order."""
    weights: tuple[str, ...]
    """Each matmul's expert weight: its ``get_attr`` target (``[E, ...]``)."""


def _is_grouped_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and "grouped_mm" in str(node.target)


def _offs(mm: fx.Node) -> object:
    """``mm``'s offsets argument (third positional, or the ``offs`` keyword)."""
    return mm.args[2] if len(mm.args) > 2 else mm.kwargs.get("offs")


def _set_offs(mm: fx.Node, offs: fx.Node) -> None:
    if len(mm.args) > 2:
        mm.update_arg(2, offs)
    else:
        mm.update_kwarg("offs", offs)


def _op_name(node: fx.Node) -> str:
    """The op's base name: ``aten.silu.default`` -> ``silu``; a method's or function's name."""
    if isinstance(node.target, str):
        return node.target
    packet = getattr(node.target, "_opname", None) or getattr(node.target, "__name__", "")
    return str(packet).split(".")[0]


def _weight(mm: fx.Node) -> str:
    """The ``get_attr`` target of ``mm``'s weight, through a transpose."""
    w = mm.args[1]
    while isinstance(w, fx.Node) and w.op != "get_attr" and _op_name(w) in ("transpose", "t"):
        w = w.args[0]
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        raise ValidationError(
            f"expert parallel: grouped matmul {mm.name}'s weight is not a parameter"
        )
    return str(w.target)


def find_sites(gm: fx.GraphModule) -> list[ExpertSite]:
    """The MoE sites of ``gm``, in graph order.

    Raises:
        ValidationError: a site does not have the shape expert parallelism cuts (one line,
            naming the node).
    """
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if _is_grouped_mm(node):
            offs = _offs(node)
            if not isinstance(offs, fx.Node):
                raise ValidationError(f"expert parallel: {node.name} has no offsets node")
            by_offs.setdefault(offs, []).append(node)
    sites = []
    for offs, mms in by_offs.items():
        site = ExpertSite(offs, tuple(mms), tuple(_weight(m) for m in mms))
        _check_site(gm, site)
        sites.append(site)
    return sites


def _between(first: fx.Node, last: fx.Node) -> set[fx.Node]:
    """The nodes on a path from ``first`` to ``last`` (both left out)."""
    after = _reach(first.users, lambda n: n.users, stop=last)
    before = _reach(last.all_input_nodes, lambda n: n.all_input_nodes, stop=first)
    return after & before


def _reach(
    start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]], stop: fx.Node
) -> set[fx.Node]:
    """The nodes reached from ``start`` by ``step``, not going through ``stop``."""
    seen: set[fx.Node] = set()
    todo = list(start)
    while todo:
        n = todo.pop()
        if n not in seen and n is not stop:
            seen.add(n)
            todo.extend(step(n))
    return seen


def _consumer(node: fx.Node) -> fx.Node | None:
    """The one node ``node`` feeds through transposes (None: several or none)."""
    while len(node.users) == 1:
        (node,) = node.users
        if _op_name(node) not in ("transpose", "t"):
            return node
    return None


def _check_site(gm: fx.GraphModule, site: ExpertSite) -> None:
    what = f"expert parallel: MoE site at {site.matmuls[0].name}"
    extra = [u.name for u in site.offs.users if u not in site.matmuls]
    if extra:
        raise ValidationError(f"{what}: its expert offsets are also used by {extra}")
    for name in site.weights:
        for node in gm.graph.nodes:
            if (
                node.op == "get_attr"
                and node.target == name
                and _consumer(node) not in site.matmuls
            ):
                raise ValidationError(f"{what}: weight {name} has other uses than its matmuls")
    first, last = site.matmuls[0], site.matmuls[-1]
    for n in _between(first, last):
        if n in site.matmuls or n.op == "get_attr":
            continue
        row_wise = n.target is operator.getitem or _op_name(n) in _ROW_WISE
        if n.op not in ("call_function", "call_method") or not row_wise:
            raise ValidationError(
                f"{what}: {n.name} ({n.target}) between its grouped matmuls is not row-wise"
            )


def _owner(gm: nn.Module, target: str) -> tuple[nn.Module, str]:
    path, _, leaf = target.rpartition(".")
    return (gm.get_submodule(path) if path else gm), leaf


def site_experts(gm: nn.Module, site: ExpertSite) -> int:
    """E: the experts of ``site`` (its first weight's leading dimension)."""
    owner, leaf = _owner(gm, site.weights[0])
    return int(getattr(owner, leaf).shape[0])


def shard_site(gm: fx.GraphModule, site: ExpertSite, coll: Collectives, tag: str) -> list[str]:
    """Cut ``site`` of ``gm`` in place for this member of ``coll``'s expert group: its weights
    become this member's experts (same names), the exchange goes around its matmuls. ``tag``
    names the two exchange modules. Call :meth:`fx.GraphModule.recompile` after the last site.

    Returns:
        The weights' names (``get_attr`` targets) now holding a shard.

    Raises:
        ValidationError: E is not a multiple of the expert width.
    """
    e, q = coll.size, coll.index
    for name in dict.fromkeys(site.weights):
        owner, leaf = _owner(gm, name)
        w = getattr(owner, leaf)
        E = int(w.shape[0])
        if E % e:
            raise ValidationError(
                f"expert parallel: {name} holds {E} experts, not a multiple of expert_width {e}"
            )
        shard = w.detach()[q * (E // e) : (q + 1) * (E // e)].clone()
        setattr(owner, leaf, nn.Parameter(shard, requires_grad=w.requires_grad))
    gm.add_module(f"{tag}_dispatch", ExpertDispatch(coll))
    gm.add_module(f"{tag}_combine", ExpertCombine(coll))
    g = gm.graph
    first, last = site.matmuls[0], site.matmuls[-1]
    x = first.args[0]
    with g.inserting_before(first):
        d = g.call_module(f"{tag}_dispatch", (x, site.offs))
        rows = g.call_function(operator.getitem, (d, 0))
        offs = g.call_function(operator.getitem, (d, 1))
        table = g.call_function(operator.getitem, (d, 2))
    first.update_arg(0, rows)
    for mm in site.matmuls:
        _set_offs(mm, offs)
    with g.inserting_after(last):
        back = g.call_module(f"{tag}_combine", (last, table))
    last.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
    return list(dict.fromkeys(site.weights))
