"""ZeRO applied to one rank's stage (:mod:`dapple.runtime.parallel.zero`): the rank's zero
stage (:func:`zero_stage_of`), which of its parameters the replicas shard
(:func:`select_zero`, :func:`flat_parameters`, :func:`tied_parameters`) and the
:class:`FlatShards` over them (:func:`build_shards`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from dapple.core.plan import Plan
from dapple.models.workload import Workload
from dapple.runtime.parallel.zero.shards import FlatShards, ShardGroup

if TYPE_CHECKING:
    from dapple.runtime.parallel.stage_mesh import StageMesh
    from dapple.runtime.train_config import TrainConfig

__all__ = [
    "RankLayers",
    "ZeroSelection",
    "build_shards",
    "flat_parameters",
    "select_zero",
    "tied_parameters",
    "unsharded_stages",
    "zero_stage_of",
]

logger = logging.getLogger(__name__)


class RankLayers(Protocol):
    """What one rank holds of the plan (:class:`dapple.runtime.rank.StageLayers`)."""

    @property
    def stage(self) -> int | None: ...
    @property
    def replica(self) -> int | None: ...
    @property
    def chunks(self) -> Mapping[int, nn.Module]: ...
    @property
    def module(self) -> nn.Module | None: ...


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


def zero_stage_of(plan: Plan, config: TrainConfig, rank: int, s: int | None) -> int:
    """The zero stage of this rank's stage: the run's ``zero_stage`` or the stage's own
    ``StagePlan.zero_stage``, the larger; 0 on a stage with one replica (and off the plan).
    Rank 0 says once which stages the run's ``zero_stage`` leaves alone (nothing to shard)."""
    single = unsharded_stages(plan)
    if rank == 0 and single and config.zero_stage:
        logger.warning(
            "zero stage %d is a no-op on stage(s) %s: one replica each (plan %s)",
            config.zero_stage, ", ".join(map(str, single)), plan.replication,
        )  # fmt: skip
    if s is None or not plan.stages[s].parallel.data_parallel:
        return 0
    mine = plan.stages_of_device(rank)  # the chunks of an interleaved plan: one device group
    return max(plan.stages[k].parallel.floored(config.zero_stage).zero_stage for k in mine)


@dataclass(frozen=True, slots=True)
class ZeroSelection:
    """The stage parameters this replica's ZeRO shards (none at zero stage 0)."""

    zero_stage: int
    """The zero stage of the rank's stage (0: nothing sharded)."""
    flat: list[nn.Parameter]
    """Parameters laid out in flat buckets (:func:`~dapple.runtime.parallel.zero.flat_parameters`)."""
    tied: list[nn.Parameter]
    """Tied parameters whose optimizer state is sharded in slices
    (:func:`~dapple.runtime.parallel.zero.tied_parameters`)."""
    held: dict[int, ShardGroup] = field(default_factory=dict)
    """``id`` of each of :attr:`flat` that fewer replicas hold -> those replicas (expert
    shards at e_s < r_s: their r_s / e_s copies)."""

    @property
    def flat_ids(self) -> frozenset[int]:
        """The ids of :attr:`flat` (the stage AllReduce leaves them to the shards)."""
        return frozenset(id(p) for p in self.flat)

    @property
    def sharded(self) -> frozenset[int]:
        """The ids of every sharded parameter (the optimizer holds their pieces)."""
        return self.flat_ids | {id(p) for p in self.tied}


def select_zero(
    plan: Plan, workload: Workload, layers: RankLayers, zero_stage: int,
    mesh: StageMesh | None = None,
) -> ZeroSelection:  # fmt: skip
    """What ZeRO at ``zero_stage`` shards of the rank's layers: ``mesh``'s expert shards over
    the r_s / e_s replicas holding each (:attr:`ZeroSelection.held`), or not at all at e_s = r_s
    (each replica updates its own whole: no other holds them)."""
    s, module, j = layers.stage, layers.module, layers.replica
    if not (zero_stage and module and s is not None):
        return ZeroSelection(zero_stage, [], [])
    st = plan.stages[s]
    if st.parallel.floored(zero_stage).shards_params:  # ZeRO-3: FSDP's own
        return ZeroSelection(zero_stage, [], [])
    flat = flat_parameters(plan, workload, s, module)
    tied = tied_parameters(plan, workload, s, module)
    ep = mesh.experts if mesh is not None else None
    if ep is None:
        return ZeroSelection(zero_stage, flat, tied)
    if ep.shard_pg is None or j is None:  # e_s = r_s
        return ZeroSelection(zero_stage, [p for p in flat if id(p) not in ep.param_ids], tied)
    copies = tuple(st.replica_devices[x] for x in st.expert_shard_replicas(j))
    group = ShardGroup(copies, ep.shard_pg, j // st.expert_width)
    held = {id(p): group for p in flat if id(p) in ep.param_ids}
    return ZeroSelection(zero_stage, flat, tied, held)


def build_shards(
    plan: Plan, layers: RankLayers, zero: ZeroSelection, pg: Any, tensor_index: int = 0
) -> FlatShards | None:
    """This replica's :class:`~dapple.runtime.parallel.zero.FlatShards` over the selected parameters
    (no bucket spans two chunks) among the replicas of its tensor index, or None when nothing
    is sharded."""
    s, j, module, chunks = layers.stage, layers.replica, layers.module, layers.chunks
    if not (zero.flat or zero.tied) or module is None or s is None or j is None:
        return None
    held = [list(chunks[k].parameters()) for k in sorted(chunks)] if len(chunks) > 1 else []
    return FlatShards(plan, s, j, module, zero.flat, pg, zero.zero_stage, tied=zero.tied,
                      chunks=held, tensor_index=tensor_index, held=zero.held)  # fmt: skip
