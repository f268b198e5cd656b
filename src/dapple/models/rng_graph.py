"""The random sites of a traced graph, and their rewrite into keyed modules (:mod:`.rng`).

:func:`number_random_sites` numbers, in the order the model runs them, the graph's dropout and
``scaled_dot_product_attention`` nodes and finds the dimension of each that holds the batch
(from the symbolic shapes ``torch.export`` traced); :func:`key_random_sites` then replaces, in a
piece cut from that graph, each numbered node by a call of a :class:`~.rng.KeyedDropout` or
:class:`~.rng.KeyedAttention` submodule, so the piece draws plan-independent masks and turns
dropout off in ``eval()``. Other random operations are reported: they keep drawing from the
process's generator.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx

from dapple.models.rng import KeyedAttention, KeyedDropout

__all__ = ["SITE", "key_random_sites", "number_random_sites"]

log = logging.getLogger(__name__)

SITE = "dapple_random_site"
"""``node.meta`` key of a random site: ``(number, batch dimension or None)``."""

_aten = torch.ops.aten
_DROPOUT = {_aten.dropout.default}
_ATTENTION = {_aten.scaled_dot_product_attention.default}
_OTHER_RANDOM = (
    "bernoulli",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "randint",
    "randint_like",
    "randperm",
    "normal",
    "uniform",
    "multinomial",
    "exponential",
    "native_dropout",
    "feature_dropout",
    "alpha_dropout",
    "feature_alpha_dropout",
    "poisson",
    "geometric",
    "cauchy",
    "log_normal",
)


def _batch_dim(val: Any, batch_syms: set[Any]) -> int | None:
    """The first dimension of fake tensor ``val`` whose size involves a batch symbol."""
    if not isinstance(val, torch.Tensor):
        return None
    for d, size in enumerate(val.shape):
        if isinstance(size, torch.SymInt) and size.node.expr.free_symbols & batch_syms:
            return d
    return None


def _is_other_random(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0].rstrip("_")
    return node.op == "call_function" and name in _OTHER_RANDOM


def number_random_sites(graph: fx.Graph, batch_syms: set[Any]) -> list[int | None]:
    """Number the random sites of ``graph`` in node order (``node.meta[SITE]``).

    Returns:
        The batch dimension of each site (None where the tensor holds no batch).
    """
    sites: list[int | None] = []
    others: set[str] = set()
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _DROPOUT | _ATTENTION:
            node.meta[SITE] = (len(sites), _batch_dim(node.meta.get("val"), batch_syms))
            sites.append(node.meta[SITE][1])
        elif _is_other_random(node):
            others.add(str(node.target))
    if others:
        log.warning(
            "random operations %s draw from each process's generator: their draws depend on "
            "the plan (dropout and attention dropout do not)",
            ", ".join(sorted(others)),
        )
    return sites


def key_random_sites(piece: fx.GraphModule) -> None:
    """Replace each numbered random site of ``piece`` by a keyed submodule, in place."""
    graph = piece.graph
    changed = False
    for node in list(graph.nodes):
        site = node.meta.get(SITE)  # a piece's input copies the meta of the value it takes
        if site is None or node.op != "call_function" or node.target not in _DROPOUT | _ATTENTION:
            continue
        number, dim = site
        name = f"dapple_random_site_{number}"
        if node.target in _DROPOUT:
            x, p, train = node.args
            module: torch.nn.Module = KeyedDropout(float(p) if train else 0.0, number, dim)
            args: tuple[Any, ...] = (x,)
            kwargs: dict[str, Any] = {}
        else:
            module = KeyedAttention(number, dim)
            args, kwargs = tuple(node.args), dict(node.kwargs)
        piece.add_submodule(name, module)
        with graph.inserting_before(node):
            new = graph.call_module(name, args, kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        piece.recompile()
