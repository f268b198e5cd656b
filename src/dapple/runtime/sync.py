"""Synchronous update (section 6.2): tied-parameter sums across stages, then AR(P_s, g_s).

Order at the end of a step, on every rank: (1) for each tied group of
``Workload.tied_parameters`` (groups of ``(layer, parameter name)`` that are one parameter in
the original model), every copy's gradient becomes the sum over all copies - copies in other
stages are summed with one AllReduce over all ranks holding a copy, on the *partial*
(not yet replica-reduced) gradients, which adds every replica's and every stage's share
exactly once; (2) each replicated stage SUMs its remaining gradients over its replica group.
Tied parameters already summed in (1) are left out of (2), so nothing is counted twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple.core.plan import Plan
from dapple.tied import sync_tied_grads
from dapple.workload import Workload

__all__ = ["GradientSync"]


class GradientSync:
    """Process groups and the end-of-step gradient reductions of one rank.

    Creating it is a collective: every rank creates every group in the same order.
    """

    def __init__(
        self, plan: Plan, workload: Workload, rank: int, module: nn.Module | None, stage: int | None
    ) -> None:
        self.groups = list(workload.tied_parameters)
        self.stage_pg: dict[int, Any] = {}
        for i, st in enumerate(plan.stages):
            if st.replicas > 1:
                self.stage_pg[i] = dist.new_group(list(st.devices))
        self.tied_pg: dict[int, Any] = {}
        for g, group in enumerate(self.groups):
            stages = sorted(
                {
                    i
                    for i, st in enumerate(plan.stages)
                    for lay, _ in group
                    if st.layers[0] <= lay < st.layers[1]
                }
            )
            if len(stages) > 1:
                ranks = sorted(d for i in stages for d in plan.stages[i].devices)
                self.tied_pg[g] = dist.new_group(ranks)
        self.module, self.stage = module, stage
        self.by_layer: dict[int, nn.Module] = {}
        cross: set[int] = set()
        if module is not None and stage is not None:
            lo, hi = plan.stages[stage].layers
            assert isinstance(module, nn.Sequential)
            self.by_layer = {lo + k: layer for k, layer in enumerate(module)}
            for g in self.tied_pg:
                for lay, name in self.groups[g]:
                    if lo <= lay < hi:
                        cross.add(id(self.by_layer[lay].get_parameter(name)))
        params = list(module.parameters()) if module is not None else []
        self.reduced = [p for p in params if id(p) not in cross]
        """Parameters the stage AllReduce sums (cross-stage tied copies are already totals)."""

    def tied(self) -> None:
        """Step (1): sum tied copies (local and, over ``tied_pg``, across stages)."""
        if not self.by_layer or not self.groups:
            return

        def group_sum(g: int, local: torch.Tensor) -> torch.Tensor:
            if g in self.tied_pg:
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.tied_pg[g])
            return local

        sync_tied_grads(self.by_layer, self.groups, group_sum)

    def stage_allreduce(self) -> None:
        """Step (2), AR(P_s, g_s): SUM the stage's gradients over its replicas in one buffer."""
        if self.stage is None or self.stage not in self.stage_pg or not self.reduced:
            return
        for p in self.reduced:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in self.reduced])  # type: ignore[union-attr]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.stage_pg[self.stage])
        off = 0
        for p in self.reduced:
            n = p.numel()
            p.grad.copy_(flat[off : off + n].view_as(p))  # type: ignore[union-attr]
            off += n
