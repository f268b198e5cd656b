"""One rank's parts of a run, each from a small typed builder.

:func:`dapple.runtime.startup.start_rank` assembles them in a fixed order (some are collectives:
the boundary probe, the process groups of :class:`~dapple.runtime.sync.GradientSync`, ZeRO's
shards): what the rank holds of the plan (:class:`StageLayers`), where each step's batch comes
from (:class:`Batches`), what the optimizer updates and the gradient norm counts
(:func:`build_optimizer`, :func:`norm_parameters`) and the executors of a plan
(:class:`ExecutorFactory`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dapple.core.plan import Plan
from dapple.core.recompute import Recompute
from dapple.errors import ValidationError
from dapple.models.shapes import DimsMap, InputShape, check_batch, run_dims
from dapple.models.workload import Workload
from dapple.runtime.chunks import Executor, RankChunks
from dapple.runtime.data import RankData, data_dims, sample_row
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.optim import counted_parameters, make_optimizer
from dapple.runtime.parallel.expert import count_expert_load, shard_experts
from dapple.runtime.parallel.stage_mesh import RankGroups, StageMesh, mesh_stage
from dapple.runtime.parallel.zero import FlatShards
from dapple.runtime.precision import Precision
from dapple.runtime.stage import StageExecutor
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.transport import BoundarySpec, flatten, infer_boundary_specs

__all__ = [
    "Batches",
    "ExecutorFactory",
    "StageLayers",
    "batch_dims",
    "build_layers",
    "build_optimizer",
    "cut_layers",
    "first_batch",
    "norm_parameters",
    "probe_boundaries",
]

Batch = tuple[Any, torch.Tensor]
"""``(inputs, targets)`` of a global batch (or of the rows a rank reads)."""


# -- what the rank holds ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageLayers:
    """What one rank holds of the plan: its stage and replica and their layers."""

    stage: int | None
    """s: the (first) stage of the rank's device group; None: a rank outside the plan."""
    replica: int | None
    """j: the rank's replica of its stages."""
    chunks: dict[int, nn.Sequential]
    """Each stage the rank holds (several: the chunks of an interleaved plan) -> its layers."""
    module: nn.Module | None
    """The rank's layers in :meth:`Plan.layers_of_device` order (its one chunk, or every
    chunk's layers in one ``nn.Sequential``); None outside the plan."""


def build_layers(
    plan: Plan, workload: Workload, seed: int, device: torch.device, rank: int
) -> StageLayers:
    """Build the layers of every stage ``rank`` holds (only those) on ``device``, in train
    mode, with the weights the single-process model has for ``seed``."""
    if rank not in plan.devices:
        return StageLayers(None, None, {}, None)
    s, j = plan.stage_of_device(rank)
    chunks = {
        k: workload.build_stage(*plan.stages[k].layers, seed).to(device)
        for k in plan.stages_of_device(rank)
    }
    module = chunks[s] if len(chunks) == 1 else nn.Sequential(*_layers_of(chunks))
    module.train()
    return StageLayers(s, j, chunks, module)


def cut_layers(
    plan: Plan, workload: Workload, layers: StageLayers, groups: RankGroups, rank: int,
    device: torch.device, autocast: bool = False,
) -> tuple[StageLayers, StageMesh]:  # fmt: skip
    """The rank's layers cut over its tensor group and/or sharded over its replicas (t_s > 1,
    zero_stage 3: :func:`~dapple.runtime.parallel.stage_mesh.mesh_stage`; e_s > 1: their experts,
    :func:`~dapple.runtime.parallel.expert.shard_experts`, their MoE sites counting the expert
    load first, :func:`~dapple.runtime.parallel.expert.load.count_expert_load`); as they are
    otherwise."""
    s, j = layers.stage, layers.replica
    if s is None or j is None:
        return layers, StageMesh(loads=count_expert_load(plan, workload, rank, None, device))
    mine = [plan.stages[k] for k in layers.chunks]
    mesh = StageMesh()
    if any(st.parallel.meshed for st in mine):
        chunks, module, mesh = mesh_stage(plan, workload, rank, layers.chunks, groups, device,
                                          autocast)  # fmt: skip
        layers = StageLayers(s, j, chunks, module)
    mesh.loads = count_expert_load(plan, workload, rank, layers.module, device, mesh.tensor_rank)
    mesh.experts = shard_experts(plan, rank, layers.module, groups.expert)
    return layers, mesh


def _layers_of(chunks: dict[int, nn.Sequential]) -> list[nn.Module]:
    """The layers of a rank's chunks, stage by stage (:meth:`Plan.layers_of_device`'s order)."""
    return [layer for k in sorted(chunks) for layer in chunks[k]]


# -- batches ----------------------------------------------------------------------------------


def first_batch(
    workload: Workload, global_batch_size: int, seed: int, data: Dataset[Any] | None
) -> Batch:
    """Step 0's global batch ``make_batch(G, seed)``, or with a dataset one real sample (what
    the boundary specs are inferred from).

    Raises:
        ValidationError: ``make_batch`` returned another number of rows than G.
    """
    if data is not None:
        return sample_row(data)
    G = global_batch_size
    inputs, targets = workload.make_batch(G, seed)
    rows = {int(t.shape[0]) for t in (*flatten(inputs), targets)}
    if rows != {G}:
        raise ValidationError(
            f"workload {workload.name!r}: make_batch({G}) returned {sorted(rows)} rows, expected {G}"
        )
    return inputs, targets


def batch_dims(
    workload: Workload, global_batch_size: int, seed: int, data: Dataset[Any] | None
) -> DimsMap:
    """The run's dynamic input dimensions: the declared ones and those that vary between
    ``make_batch`` draws (:func:`~dapple.models.shapes.run_dims`), or on a dataset the declared
    ones (padded documents declare their length)."""
    if data is None:
        return run_dims(workload, global_batch_size, seed)
    return data_dims(workload)


@dataclass(frozen=True)
class Batches:
    """Where each step's global batch comes from, checked against the first batch's shapes."""

    workload: Workload
    seed: int
    global_batch_size: int
    first: Batch
    """Step 0's batch (:func:`first_batch`): synthetic batches only."""
    feed: RankData
    """The run's dataset batches (training and evaluation), when it has datasets."""
    shapes: tuple[InputShape, ...]
    """The first batch's input shapes (what :func:`check_batch` compares a step's with)."""
    dims: DimsMap
    """The run's dynamic input dimensions (declared and found); empty: static shapes."""

    def batch(self, step: int) -> Batch:
        """Step ``step``'s global batch: ``make_batch(G, seed + step)``, or the data's.

        Raises:
            ValidationError: its inputs do not fit the model (:func:`check_batch`), before
                the step computes anything.
        """
        if self.feed.source is not None:
            batch = self.feed.batch(step)
            if self.dims:
                check_batch(self.shapes, self.dims, batch[0], where=f"step {step}")
            return batch
        if step == 0:
            return self.first
        batch = self.workload.make_batch(self.global_batch_size, self.seed + step)
        check_batch(self.shapes, self.dims, batch[0], where=f"step {step}")
        return batch

    def eval_batch(self, k: int) -> Batch:
        """Evaluation batch ``k`` of ``eval_data``: samples ``[k*G, (k+1)*G)`` in order."""
        return self.feed.eval_batch(k)


def probe_boundaries(
    plan: Plan,
    rank: int,
    layers: StageLayers,
    inputs: Any,
    device: torch.device,
    precision: Precision,
) -> list[BoundarySpec]:
    """The spec of every stage boundary, from one row of ``inputs`` run through the stages
    under ``precision``'s autocast (the boundary buffers get the dtype it produces).
    Collective: every rank."""
    sample = tuple(t[:1] for t in flatten(inputs))
    probe = sample if isinstance(inputs, (tuple, list)) else sample[0]
    with precision.autocast():
        return infer_boundary_specs(plan, rank, layers.chunks, probe, device)


# -- the optimizer ----------------------------------------------------------------------------


def build_optimizer(
    config: TrainConfig,
    params: list[nn.Parameter],
    sharded: frozenset[int],
    shards: FlatShards | None,
) -> tuple[list[nn.Parameter], torch.optim.Optimizer | None]:
    """The optimizer's parameters - this replica's pieces of the sharded ones, then the others
    whole - and the optimizer over them (None: nothing to update)."""
    updated = [p for p in params if id(p) not in sharded]
    if shards is not None:
        updated = [pc.param for pc in shards.pieces] + updated
    like = {id(pc.param): pc.origin for pc in shards.pieces} if shards is not None else {}
    return updated, make_optimizer(config, updated, like) if updated else None


def norm_parameters(
    plan: Plan,
    workload: Workload,
    layers: StageLayers,
    sharded: frozenset[int],
    shards: FlatShards | None,
    mesh: StageMesh | None = None,
) -> list[nn.Parameter]:
    """The parameters whose gradients this rank adds to the global gradient norm: what its
    stage counts (:func:`~dapple.runtime.optim.counted_parameters`), each sharded one as this
    replica's pieces of what the stage's replica 0 counts; a cut stage's as
    :meth:`StageMesh.norm_counted` says."""
    s, j, module = layers.stage, layers.replica, layers.module
    cut = mesh is not None and mesh.cut and module is not None and j is not None

    def stage_counts(replica: int | None) -> list[nn.Parameter]:
        if cut:  # of a tied parameter, the copy replica 0 counts
            assert mesh is not None and module is not None and replica is not None
            once = {id(p) for p in counted_parameters(plan, workload, s, 0, module)}
            return [p for p in mesh.norm_counted(module, replica) if id(p) in once]
        return counted_parameters(plan, workload, s, replica, module)

    counted = [p for p in stage_counts(j) if id(p) not in sharded]
    if shards is not None:  # expert shards sharded over their copies: every rank its pieces
        ep = mesh.experts if mesh is not None else None
        counted = shards.counted([*stage_counts(0), *(ep.params if ep else [])]) + counted
    return counted


# -- executors --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecutorFactory:
    """This rank's executor of a plan over its layers: one
    :class:`~dapple.runtime.stage.StageExecutor` per chunk it holds (:class:`RankChunks` over
    several); the training plan's and an evaluation plan's share the layers."""

    layers: StageLayers
    specs: list[BoundarySpec]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    device: torch.device
    recompute: Recompute | None
    """The run's re-computation of every stage (``TrainConfig.recompute``); None: each
    stage's own ``StagePlan.recompute``."""
    meter: ActivationMeter
    precision: Precision
    dynamic: bool
    """Shape-headed messages: the run has dynamic input dimensions."""
    seed: int
    mesh: StageMesh | None = None
    """The rank's cut stage (its tensor index, ZeRO-3's micro-batch switch)."""

    def __call__(self, run: Plan, training: bool) -> Executor | None:
        """The executor of ``run`` (re-computation only when ``training``); None outside it."""
        j = self.layers.replica
        if j is None:
            return None
        exs = []
        for k, mod in self.layers.chunks.items():
            chosen = run.stages[k].recompute if self.recompute is None else self.recompute
            recompute = training and bool(chosen)
            mesh = self.mesh or StageMesh()
            ex = StageExecutor(run, k, j, mod, self.specs, self.loss_fn, self.device, recompute,
                               self.meter, self.precision, dynamic=self.dynamic, seed=self.seed,
                               tensor_rank=mesh.tensor_rank)  # fmt: skip
            shard = mesh.shards.get(k)
            if training and shard is not None:
                ex.before_backward = shard.before_backward
                ex.after_weights = shard.after_weights
                ex.live_weights = True
            exs.append(ex)
        return exs[0] if len(exs) == 1 else RankChunks(exs)
