"""Expert load per step: the token rows each MoE layer's router sends to each of its experts,
counted on the device and summed over the ranks in the step's one collective.

- **Layout** (:func:`load_layout`). Every MoE site of the model (traced grouped-matmul experts,
  :mod:`.sites`), in layer order, owns E columns of one vector of C = sum of E; every rank reads
  it off the traced pieces' templates, so all ranks agree on it (C = 0: no site, nothing counted).
- **Counting** (:func:`count_expert_load`). A pass-through node on each site's offsets (the
  cumulative rows per expert, ``offs``) adds the rows per expert to a float64 counter on the
  device: no host read. A row is one (token, chosen expert) pair, so a layer's loads sum to its
  tokens times top-k. Forwards without gradients (the boundary probe, evaluation) and the
  re-computation inside a backward are not counted; tensor ranks other than 0 count nothing
  (their group routes the same rows). Under expert parallelism each replica counts its own rows
  by global expert before they are dispatched (it is placed before :func:`.shard_experts` cuts
  the site).
- **Router probabilities.** Where the site's routing comes from a ``topk`` of a ``softmax`` (the
  router's probabilities, ``[tokens, E]``: Mixtral's, Qwen2-MoE's), a second pass-through node
  sums them per expert over the tokens, under the same rule, for the load-balancing loss.
- **Step** (:meth:`ExpertLoads.vector`): the rank's counts and sums (2 x C columns, zeros outside
  its layers), summed over the ranks on the device and read with the step's row
  (:meth:`~dapple.runtime.guard.NonFiniteGuard.agree_finite`'s ``summed``);
  :meth:`ExpertLoads.begin_step` zeroes the counters.

Balance is reported as max/mean load per layer (:func:`imbalance`): 1 when every expert got the
same rows, E when one expert got them all; and as each layer's load-balancing loss
(:func:`aux_loss`, ``transformers``' ``load_balancing_loss_func`` on one layer):
``E * sum_i (load_i / T) * (P_i / T)``, with P_i the router's probabilities of expert i summed
over the step's T tokens (T = sum_i P_i: each token's probabilities sum to 1); k when balanced.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.models.split import piece_template
from dapple.models.workload import Workload
from dapple.runtime.parallel.expert.sites import ExpertSite, find_sites, site_experts

__all__ = [
    "ExpertLoadCounter",
    "ExpertLoads",
    "LoadLayout",
    "aux_loss",
    "count_expert_load",
    "expert_report",
    "imbalance",
    "load_layout",
    "router_probs",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadLayout:
    """Where each MoE site's loads sit in the step's load vector."""

    layers: tuple[int, ...] = ()
    """The layer of each site, in model order (a layer may hold several)."""
    experts: tuple[int, ...] = ()
    """E of each site."""
    sites: tuple[int, ...] = ()
    """Each site's index among its layer's sites (graph order)."""

    @property
    def columns(self) -> int:
        """The vector's length, 2 x C: each site's E loads, then its E summed probabilities."""
        return 2 * sum(self.experts)

    def offset(self, layer: int, site: int) -> int:
        """The first column of site ``site`` of layer ``layer`` (its loads; its sums follow)."""
        k = list(zip(self.layers, self.sites, strict=True)).index((layer, site))
        return 2 * sum(self.experts[:k])

    def split(self, sums: Sequence[float]) -> tuple[tuple[tuple[int, ...], ...], tuple[float, ...]]:
        """The summed vector as per-site loads (rounded: they are counts) and load-balancing
        losses (:func:`aux_loss`; NaN where the site's router probabilities are not summed)."""
        loads, losses, at = [], [], 0
        for e in self.experts:
            load = tuple(round(x) for x in sums[at : at + e])
            loads.append(load)
            losses.append(aux_loss(load, sums[at + e : at + 2 * e]))
            at += 2 * e
        return tuple(loads), tuple(losses)


def load_layout(workload: Workload) -> LoadLayout:
    """The MoE sites of ``workload``'s traced pieces (empty: not traced, or no site)."""
    layers, experts, sites = [], [], []
    for i in range(workload.num_layers):
        piece = piece_template(workload, i)
        if not isinstance(piece, fx.GraphModule):
            return LoadLayout()
        try:
            found = find_sites(piece)
        except ValidationError as e:  # a site of another shape: counted nowhere, said once
            logger.info("expert load: layer %d not counted: %s", i, e)
            continue
        for n, site in enumerate(found):
            layers.append(i)
            experts.append(site_experts(piece, site))
            sites.append(n)
    return LoadLayout(tuple(layers), tuple(experts), tuple(sites))


def imbalance(load: Sequence[int]) -> float:
    """max/mean of ``load`` (1.0: balanced; 0 rows: 1.0)."""
    total = sum(load)
    return max(load) * len(load) / total if total else 1.0


def aux_loss(load: Sequence[int], prob_sums: Sequence[float]) -> float:
    """``E * sum_i (load_i / T) * (P_i / T)``, T = sum of ``prob_sums`` (NaN when 0: no sums)."""
    T = sum(prob_sums)
    if T <= 0:
        return math.nan
    return len(load) * sum(n * q for n, q in zip(load, prob_sums, strict=True)) / (T * T)


def _rows_per_expert(offs: torch.Tensor) -> torch.Tensor:
    ends = offs.long()
    return torch.diff(ends, prepend=ends.new_zeros(1))


class ExpertLoadCounter(nn.Module):
    """``offs -> offs``, adding the rows per expert of each counted forward to :attr:`counts`."""

    def __init__(self, experts: int, device: torch.device, active: bool = True) -> None:
        super().__init__()
        self.counts = torch.zeros(2 * experts, dtype=torch.float64, device=device)
        """Rows per expert, then the router's probabilities summed per expert, since the last
        :meth:`ExpertLoads.begin_step` (not a buffer: no checkpoint holds it)."""
        self.experts = experts
        self.active = active

    def counting(self) -> bool:
        """Count this call: active, with gradients (not the probe or evaluation) and not inside
        a backward (re-computation)."""
        return self.active and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def forward(self, offs: torch.Tensor) -> torch.Tensor:
        if self.counting():
            self.counts[: self.experts] += _rows_per_expert(offs).to(torch.float64)
        return offs


class RouterProbSum(nn.Module):
    """``probs -> probs`` (``[..., E]``), adding them summed over the tokens to the second half
    of its :class:`ExpertLoadCounter`'s counts."""

    def __init__(self, counter: ExpertLoadCounter) -> None:
        super().__init__()
        self.counter = [counter]  # in a list: not registered twice as a module

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        c = self.counter[0]
        if c.counting():
            c.counts[c.experts :] += probs.detach().reshape(-1, c.experts).sum(0).double()
        return probs


def _op(node: fx.Node) -> str:
    """The op's base name (``aten.topk.default`` -> ``topk``)."""
    target = node.target
    packet = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return str(packet).split(".")[0]


def router_probs(site: ExpertSite) -> fx.Node | None:
    """The router's probabilities feeding ``site``'s routing: the ``softmax`` whose ``topk``
    the offsets come from (None: no such pair)."""
    seen: set[fx.Node] = set()
    todo = [site.offs]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and _op(n) == "topk":
            probs = n.args[0]
            if isinstance(probs, fx.Node) and _op(probs) in ("softmax", "_softmax"):
                return probs
            return None
        todo.extend(n.all_input_nodes)
    return None


def _through(gm: fx.GraphModule, value: fx.Node, module: nn.Module, name: str) -> None:
    """Put ``module`` between ``value`` and its users (they read its output)."""
    gm.add_module(name, module)
    with gm.graph.inserting_after(value):
        node = gm.graph.call_module(name, (value,))
    value.replace_all_uses_with(node, delete_user_cb=lambda u: u is not node)


def _count_site(
    gm: fx.GraphModule, site: ExpertSite, counter: ExpertLoadCounter, name: str
) -> None:
    """Put ``counter`` between ``site``'s offsets and its matmuls, and its
    :class:`RouterProbSum` after the router's probabilities where found."""
    probs = router_probs(site)
    _through(gm, site.offs, counter, name)
    if probs is not None:
        _through(gm, probs, RouterProbSum(counter), f"{name}_probs")


@dataclass
class ExpertLoads:
    """One rank's expert-load counters and the model's layout."""

    layout: LoadLayout
    device: torch.device
    counters: dict[int, ExpertLoadCounter] = field(default_factory=dict)
    """Column offset -> the counter of the site there (the rank's own sites)."""

    def begin_step(self) -> None:
        """Zero the counters (before the step's first forward)."""
        for c in self.counters.values():
            c.counts.zero_()

    def vector(self) -> torch.Tensor:
        """This rank's step loads as C float64 columns on the device (zeros outside its sites);
        no host read."""
        out = torch.zeros(self.layout.columns, dtype=torch.float64, device=self.device)
        for at, c in self.counters.items():
            out[at : at + c.counts.numel()] = c.counts
        return out


def count_expert_load(
    plan: Plan,
    workload: Workload,
    rank: int,
    module: nn.Module | None,
    device: torch.device,
    tensor_rank: int = 0,
) -> ExpertLoads | None:
    """Count the expert load of ``rank``'s layers (``module``: its pieces in
    :meth:`Plan.layers_of_device` order, changed in place; None: a rank beyond the plan, which
    sends zeros). Call before :func:`.shard_experts`.

    Returns:
        None when the model has no MoE site to count (then nothing is gathered).
    """
    layout = load_layout(workload)
    if not layout.columns:
        return None
    loads = ExpertLoads(layout, device)
    if module is None or rank not in plan.devices:
        return loads
    pieces = list(module.children())
    for layer, piece in zip(plan.layers_of_device(rank), pieces, strict=True):
        if layer not in layout.layers or not isinstance(piece, fx.GraphModule):
            continue
        try:
            sites = find_sites(piece)
        except ValidationError as e:  # cut otherwise (TP): its columns stay 0, said once
            logger.info("expert load: layer %d not counted on rank %d: %s", layer, rank, e)
            continue
        want = dict(zip(zip(layout.layers, layout.sites, strict=True), layout.experts, strict=True))
        for n, site in enumerate(sites):
            E = site_experts(piece, site)
            if want.get((layer, n)) != E:
                logger.info("expert load: layer %d site %d (%d experts) not counted", layer, n, E)
                continue
            counter = ExpertLoadCounter(E, device, tensor_rank == 0)
            _count_site(piece, site, counter, f"dapple_expert_load_{n}")
            loads.counters[layout.offset(layer, n)] = counter
        piece.recompile()
    return loads


def expert_report(
    loads: ExpertLoads | None,
    split: tuple[tuple[tuple[int, ...], ...], tuple[float, ...]],
) -> dict[str, Any]:
    """The :class:`~dapple.runtime.train_config.StepMetrics` fields of a step's summed counts
    (:meth:`LoadLayout.split`): ``expert_layers``, ``expert_load``, ``expert_imbalance`` and
    ``expert_aux_loss`` (None where not summed); none without counters."""
    if loads is None:
        return {}
    load, losses = split
    return {
        "expert_layers": loads.layout.layers,
        "expert_load": load,
        "expert_imbalance": tuple(imbalance(x) for x in load),
        "expert_aux_loss": tuple(None if math.isnan(x) else x for x in losses),
    }
