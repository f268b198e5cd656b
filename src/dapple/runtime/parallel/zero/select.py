"""Which parameters of a stage its replicas shard (:mod:`dapple.runtime.parallel.zero`)."""

from __future__ import annotations

from torch import nn

from dapple.core.plan import Plan
from dapple.models.workload import Workload

__all__ = ["flat_parameters", "tied_parameters", "unsharded_stages"]


def unsharded_stages(plan: Plan) -> list[int]:
    """The stages a zero stage does not change: those with one replica."""
    return [i for i, st in enumerate(plan.stages) if not st.parallel.data_parallel]


def _tied_ids(plan: Plan, workload: Workload, stage: int, module: nn.Module) -> set[int]:
    """``id`` of each of the stage's copies of a tied parameter (``Workload.tied_parameters``)."""
    held = plan.layers_of_device(plan.stages[stage].devices[0])  # every chunk's, when v > 1
    layers = dict(zip(held, module.children(), strict=False))
    return {
        id(layers[int(i)].get_parameter(str(name)))
        for group in workload.tied_parameters
        for i, name in group
        if int(i) in layers
    }


def flat_parameters(
    plan: Plan, workload: Workload, stage: int, module: nn.Module
) -> list[nn.Parameter]:
    """The parameters of stage ``stage`` that :class:`FlatShards` puts in flat buckets: the
    trainable ones of the first such parameter's dtype and device, without those of tied
    groups."""
    tied = _tied_ids(plan, workload, stage, module)
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in tied]
    if not params:
        return []
    kind = (params[0].dtype, params[0].device)
    return [p for p in params if (p.dtype, p.device) == kind]


def tied_parameters(
    plan: Plan, workload: Workload, stage: int, module: nn.Module
) -> list[nn.Parameter]:
    """The stage's trainable, contiguous copies of tied parameters: :class:`FlatShards` shards
    their optimizer state in slices (their gradients are summed whole, across stages)."""
    tied = _tied_ids(plan, workload, stage, module)
    return [
        p
        for p in dict.fromkeys(module.parameters())
        if id(p) in tied and p.requires_grad and p.is_contiguous()
    ]
