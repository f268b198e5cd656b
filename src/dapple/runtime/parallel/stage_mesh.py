"""A stage's 2-D mesh at run time: tensor groups (TP, t_s > 1) and sharded parameters (ZeRO-3).

A stage of ``r_s x t_s`` devices (replica-major: replica ``j``'s tensor group is
``devices[j*t:(j+1)*t]``, :class:`~dapple.core.plan.StagePlan`) runs as follows:

- **Groups.** Every rank creates every group in one order (:func:`make_groups`): for each stage
  of the first ``num_groups``, the replica groups per tensor index ``i`` (``devices[i::t]``,
  when ``r_s > 1``), then the tensor groups per replica (when ``t_s > 1``). The replica
  AllReduce of :class:`~dapple.runtime.sync.GradientSync` runs on the group of the rank's own
  tensor index, so a cut parameter's shard is only summed with the same shard of the others.
- **Layers.** Each chunk the rank holds (several under interleaved 1F1B, all on the device
  group's one mesh) is cut with :func:`dapple.runtime.parallel.tp.parallelize_stage` over the tensor
  group, on the model's TP plan (:func:`tp_plan_of`); with ``zero_stage`` 3 the (cut) chunk is
  then wrapped with FSDP2 on its replica group (:func:`dapple.runtime.parallel.fsdp.shard_stage`), a
  root of its own (:class:`ChunkShard`), which reduce-scatters the gradients after the chunk's
  last backward of the step - by hand after its last ``W`` or backward under a split backward
  or autocast (:attr:`ChunkShard.held`) - so the stage AllReduce leaves its parameters alone.
- **Transfers.** Stage outputs are whole on every tensor rank (the row-parallel ``g`` makes
  them so), and so are input gradients (the column-parallel ``f`` all-reduces them), so each
  receiving rank of tensor index ``k`` takes its message from the sending group's rank
  ``k mod t_sender`` (:func:`peer_ranks`): no broadcast inside the group, and every rank of a
  wider group gets its input straight from a peer.
- **Loss and norm.** The loss is counted by tensor rank 0 only; the global gradient norm
  counts a cut parameter's shard on every tensor rank and a whole one on tensor rank 0
  (ZeRO-3: each replica its own shard).

What is not wired yet is refused before any compute (:func:`check_mesh_run`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dapple.core.plan import Plan, StagePlan
from dapple.core.precision import precision_of
from dapple.errors import ValidationError
from dapple.models.tp_plan import tp_plan_of
from dapple.models.workload import Workload
from dapple.runtime import comm
from dapple.runtime.parallel.expert import (
    ExpertGroups,
    ExpertLoads,
    ExpertShards,
    check_expert_layers,
    check_expert_run,
    make_expert_groups,
)
from dapple.runtime.parallel.fsdp import (
    begin_micro_batch,
    hold_gradients,
    reduce_gradients,
    shard_stage,
)
from dapple.runtime.parallel.tp import TensorParallelModule, parallelize_stage
from dapple.runtime.parallel.zero import FlatShards
from dapple.runtime.train_config import TrainConfig
from dapple.schedule.registry import get_schedule

__all__ = [
    "ChunkShard",
    "RankGroups",
    "StageMesh",
    "check_mesh_run",
    "make_groups",
    "mesh_stage",
    "peer_ranks",
    "tensor_programs",
    "whole_layers",
    "whole_observer",
    "whole_parameters",
    "zero_floored",
]


def zero_floored(plan: Plan, zero_stage: int) -> Plan:
    """``plan`` with the run's ``zero_stage`` (``TrainConfig.zero_stage``) as a floor: each
    stage with more than one replica per tensor index gets at least that zero stage. ZeRO-3
    is carried by the plan's stages (each such stage an FSDP2 root), so a run-wide 3 is written
    into them here; 1 and 2 are also applied per rank by the engine. ``plan`` itself when
    nothing changes."""
    stages = tuple(
        replace(st, zero_stage=st.parallel.floored(zero_stage).zero_stage) for st in plan.stages
    )
    return plan if stages == plan.stages else replace(plan, stages=stages)


def _meshed(plan: Plan) -> list[tuple[int, StagePlan]]:
    """The (virtual) stages cut over a tensor group or sharded over their replicas."""
    return [(s, st) for s, st in enumerate(plan.stages) if st.parallel.meshed]


def check_mesh_run(plan: Plan, workload: Workload, config: TrainConfig) -> None:
    """Refuse, before any compute, what the runtime does not run yet with t_s > 1, ZeRO-3 or
    e_s > 1.

    Raises:
        ValidationError: one line naming the stage and what is unsupported.
    """
    check_expert_run(zero_floored(plan, config.zero_stage), config)
    check_expert_layers(plan, workload)
    meshed = _meshed(zero_floored(plan, config.zero_stage))
    for s, st in meshed:
        what = f"stage {s} {list(st.layers)} (tensor_width {st.tensor_width}, zero {st.zero_stage})"
        if st.parallel.tensor_parallel and not tp_plan_of(workload):
            raise ValidationError(f"{what}: model {workload.name!r} has no TP plan")
        tied = [(i, n) for g in workload.tied_parameters for i, n in g
                if st.layers[0] <= i < st.layers[1]]  # fmt: skip
        if tied and st.parallel.shards_params:
            raise ValidationError(
                f"{what}: ZeRO-3 on a stage holding tied parameters {tied} is not supported"
            )
        precision = precision_of(config.precision)
        if precision.loss_scaling:
            raise ValidationError(
                f"{what}: precision {config.precision} with TP or ZeRO-3 is not supported yet"
            )
        if st.regather and precision.autocast:
            raise ValidationError(
                f"{what}: ZeRO-3 regather with precision {config.precision} is not supported"
            )


# -- process groups ------------------------------------------------------------------------------
@dataclass
class RankGroups:
    """Every replica and tensor group of a plan (created on every rank, in the same order)."""

    replica: dict[tuple[int, int], Any] = field(default_factory=dict)
    """``(stage, tensor index i)`` -> the group of ``devices[i::t]`` (stages with r_s > 1)."""
    tensor: dict[tuple[int, int], Any] = field(default_factory=dict)
    """``(stage, replica j)`` -> the group of ``tensor_group(j)`` (stages with t_s > 1)."""
    expert: ExpertGroups = field(default_factory=ExpertGroups)
    """The expert and expert-shard groups (stages with e_s > 1)."""

    def all(self) -> list[Any]:
        """Every group, in creation order (destroy them in it)."""
        return [*self.replica.values(), *self.tensor.values(), *self.expert.all()]


def make_groups(plan: Plan) -> RankGroups:
    """Create the plan's replica groups (per tensor index), then its tensor groups, then its
    expert groups. Collective."""
    out = RankGroups()
    stages = plan.stages[: plan.num_groups]
    for s, st in enumerate(stages):
        if st.parallel.data_parallel:
            for i in range(st.tensor_width):
                out.replica[(s, i)] = dist.new_group(list(st.replica_group(i)))
    for s, st in enumerate(stages):
        if st.parallel.tensor_parallel:
            for j in range(st.replicas):
                out.tensor[(s, j)] = dist.new_group(list(st.tensor_group(j)))
    out.expert = make_expert_groups(plan)
    return out


def tensor_index(plan: Plan, rank: int) -> int:
    """``rank``'s index in its tensor group (0 off the plan)."""
    if rank not in plan.devices:
        return 0
    st = plan.stages[plan.stage_of_device(rank)[0]]
    return st.devices.index(rank) % st.tensor_width


def peer_ranks(
    other: StagePlan, replica: int, tensor_rank: int, t_self: int, sends: bool
) -> list[int]:
    """The ranks of ``other``'s replica ``replica`` that a rank of tensor index ``tensor_rank``
    (in a group of ``t_self``) sends to (``sends``) or receives its one message from: a rank of
    index ``k`` receives from the sender of index ``k mod t_sender``."""
    group = other.tensor_group(replica)
    if sends:
        return [d for k, d in enumerate(group) if k % t_self == tensor_rank]
    return [group[tensor_rank % other.tensor_width]]


# -- the stage's layers -------------------------------------------------------------------------
@dataclass
class ChunkShard:
    """One chunk's FSDP2 wrapping (ZeRO-3) and when it reduce-scatters: its own ``M``
    micro-batches, whatever the other chunks of an interleaved plan do."""

    fsdp: nn.Module
    """The FSDP-wrapped chunk (a root of its own)."""
    regather: bool = False
    num_micro_batches: int = 1
    held: bool = False
    """No backward reduce-scatters: the chunk's ``M``-th weight gradients do, by hand
    (:meth:`after_weights`). Needed where FSDP2's post-backward, which fires when the gradient
    reaches the chunk's inputs, can come before a weight's gradient is complete: a split
    backward (``I`` then ``W``), and autocast, whose one cached low-precision copy of a weight
    per step is a node autograd runs after the inputs' gradients."""
    _weights_done: int = 0

    def before_backward(self, m: int) -> None:
        """Reduce-scatter (and reshard) only after micro-batch ``M-1``'s backward (``held``: in
        none, :meth:`after_weights` does)."""
        sharded: Any = self.fsdp
        if self.held:
            hold_gradients(sharded)
        else:
            begin_micro_batch(sharded, m, self.num_micro_batches, regather=self.regather)

    def after_weights(self, m: int) -> None:
        """After micro-batch ``m``'s weight gradients (its ``W``, or its whole backward):
        ``held``, the step's ``M``-th reduce-scatters."""
        if not self.held:
            return
        self._weights_done += 1
        if self._weights_done == self.num_micro_batches:
            self._weights_done = 0
            reduce_gradients(self.fsdp)  # type: ignore[arg-type]


@dataclass
class StageMesh:
    """How one rank's stage (its chunks, interleaved) is cut: TP and FSDP wrapping, both
    optional."""

    tensor_rank: int = 0
    tp: TensorParallelModule | None = None
    """The rank's layers cut over its tensor group, as one module (every chunk's cut layers in
    :meth:`Plan.layers_of_device` order; the layouts named in it)."""
    shards: dict[int, ChunkShard] = field(default_factory=dict)
    """Stage index -> its chunk's FSDP wrapping (the ZeRO-3 chunks of the rank)."""
    experts: ExpertShards | None = None
    """The rank's expert shards (e_s > 1, :mod:`dapple.runtime.parallel.expert`)."""
    loads: ExpertLoads | None = None
    """The rank's expert-load counters (:mod:`dapple.runtime.parallel.expert.load`; None: the
    model has no MoE layer to count)."""

    @property
    def cut(self) -> bool:
        return self.tp is not None or bool(self.shards) or self.experts is not None

    def fsdp_units(self) -> list[nn.Module]:
        """The FSDP-wrapped chunks (one root each)."""
        return [c.fsdp for c in self.shards.values()]

    def norm_counted(self, module: nn.Module, replica: int) -> list[nn.Parameter]:
        """This rank's parameters in the global gradient norm: cut shards on every tensor rank,
        whole parameters on tensor rank 0; replica 0 only unless ZeRO-3 (each its shard); with
        expert shards, as :meth:`ExpertShards.norm_counted` says."""
        if self.experts is not None:
            return self.experts.norm_counted(module, replica)
        if replica != 0 and not self.shards:
            return []
        cut = set(self.tp.layouts) if self.tp is not None else set()
        return [p for n, p in module.named_parameters() if n in cut or self.tensor_rank == 0]


def mesh_stage(
    plan: Plan, workload: Workload, rank: int, chunks: Mapping[int, nn.Sequential],
    groups: RankGroups, device: torch.device, autocast: bool = False,
) -> tuple[dict[int, nn.Sequential], nn.Sequential, StageMesh]:  # fmt: skip
    """Cut ``rank``'s chunks over its tensor group and/or shard each over its replicas
    (``autocast``: the run computes in a low precision, :attr:`ChunkShard.held`).

    Returns:
        The cut chunks by stage index, the rank's layers as one module (the one chunk itself,
        or every chunk's layers in one ``nn.Sequential``) and how they are cut.

    Raises:
        ValidationError: the TP plan cuts no layer of any of the rank's chunks.
    """
    s, j = plan.stage_of_device(rank)
    mesh = StageMesh(tensor_index(plan, rank))
    held = autocast or get_schedule(plan.schedule).split_backward
    tp = _cut_chunks(plan, workload, chunks, groups.tensor.get((s, j)))
    out: dict[int, nn.Sequential] = {}
    for k in sorted(chunks):
        module: nn.Module = tp[k].module if k in tp else chunks[k]
        st = plan.stages[k]
        if st.parallel.shards_params:
            pg = groups.replica[(s, mesh.tensor_rank)]
            shard_stage(module, DeviceMesh.from_group(pg, device.type), regather=st.regather)
            mesh.shards[k] = ChunkShard(module, st.regather, plan.num_micro_batches, held)
        assert isinstance(module, nn.Sequential)  # the pieces, in place (FSDP swaps the class)
        module.train()
        out[k] = module
    whole = out[s] if len(out) == 1 else nn.Sequential(*(x for k in sorted(out) for x in out[k]))
    if tp:
        mesh.tp = _joined(tp, out, whole)
        _check_tied_uncut(plan, workload, rank, mesh.tp)
    return out, whole, mesh


def _check_tied_uncut(plan: Plan, workload: Workload, rank: int, tp: TensorParallelModule) -> None:
    """A tied parameter stays whole on every tensor rank (its copies in other stages are)."""
    position = {layer: k for k, layer in enumerate(plan.layers_of_device(rank))}
    for group in workload.tied_parameters:
        for layer, name in group:
            if layer in position and f"{position[layer]}.{name}" in tp.layouts:
                raise ValidationError(
                    f"tensor parallel: layer {layer}'s {name} is tied to {list(group)} and "
                    "the TP plan cuts it; tied parameters must stay whole"
                )


def _cut_chunks(
    plan: Plan, workload: Workload, chunks: Mapping[int, nn.Sequential], group: Any
) -> dict[int, TensorParallelModule]:
    """Each chunk cut over the tensor group ``group`` (None: t_s = 1, nothing cut); a chunk of
    an interleaved plan that holds no layer of the TP plan runs whole on every tensor rank."""
    if group is None:
        return {}
    plan_map = tp_plan_of(workload)
    tp = {k: parallelize_stage(c, plan_map, group, require=len(chunks) == 1)
          for k, c in chunks.items()}  # fmt: skip
    if not any(t.layouts for t in tp.values()):
        stages = sorted(chunks)
        raise ValidationError(
            f"tensor parallel: the TP plan cuts no layer of stages {stages} "
            f"(layers {[list(plan.stages[k].layers) for k in stages]})"
        )
    return tp


def _joined(
    tp: Mapping[int, TensorParallelModule], out: Mapping[int, nn.Sequential], whole: nn.Module
) -> TensorParallelModule:
    """The chunks' TP modules as one over ``whole``: each chunk's layouts renamed from its own
    piece index to the piece's index in ``whole``."""
    layouts = {}
    offset = 0
    for k in sorted(out):
        for name, lay in tp[k].layouts.items():
            piece, _, rest = name.partition(".")
            moved = f"{int(piece) + offset}.{rest}"
            layouts[moved] = replace(lay, name=moved)
        offset += len(out[k])
    first = next(iter(tp.values()))
    return replace(first, module=whole, layouts=layouts)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_parameters(
    mesh: StageMesh, module: nn.Module, grads: bool, shards: FlatShards | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient: zeros where none) of the stage whole, by name: gathered
    over the replica group (ZeRO-3, or a ZeRO-1/2 gradient from this replica's ``shards``),
    the expert group (expert shards), then the tensor group. Collective on all three."""
    local: dict[str, torch.Tensor] = {}
    for n, p in module.named_parameters():
        t = p.grad if grads else p.detach()
        local[n] = _local(t if t is not None else torch.zeros_like(p)).detach()
    if grads and shards is not None:
        local |= _summed_pieces(module, shards)
    if mesh.experts is not None:
        local = mesh.experts.whole(local)
    if mesh.tp is None:
        return local
    return mesh.tp.full_parameters(grads, local=local)


def _summed_pieces(module: nn.Module, shards: FlatShards) -> dict[str, torch.Tensor]:
    """Each ZeRO-1/2 parameter's reduced gradient, whole over the replicas: this replica's
    pieces at their offsets, summed over the group it is sharded over (each element is one
    member's): the replica group, or an expert shard's copies. Collective on those groups."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = {
        names[id(p)]: torch.zeros(p.shape, dtype=p.dtype, device=p.device) for p in shards.params
    }
    pgs = {names[id(p)]: shards.group_of(p).pg for p in shards.params}
    for pc in shards.pieces:  # a tied parameter's pieces: its gradient is whole already
        name = names.get(id(pc.origin))
        if name in out and pc.param.grad is not None:
            flat = out[name].view(-1)
            flat[pc.offset : pc.offset + pc.param.numel()] = pc.param.grad.reshape(-1)
    for name in sorted(out):  # every replica: the same parameters, in the same order
        comm.all_reduce(out[name], op=dist.ReduceOp.SUM, group=pgs[name])
    return out


def whole_layers(
    mesh: StageMesh,
    module: nn.Module,
    layer_ids: tuple[int, ...],
    grads: bool,
    shards: FlatShards | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """:func:`whole_parameters` by layer index (the module's children are its layers)."""
    whole = whole_parameters(mesh, module, grads, shards)
    out: dict[int, dict[str, torch.Tensor]] = {i: {} for i in layer_ids}
    for n, t in whole.items():
        k, _, name = n.partition(".")
        out[layer_ids[int(k)]][name] = t.cpu()
    return out


def layer_module(
    params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]
) -> nn.Module:
    """A plain module holding ``params`` under their dotted names, each with its gradient."""
    root = nn.Module()
    for name, t in params.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        p = nn.Parameter(t.clone(), requires_grad=False)
        p.grad = grads[name].clone()
        owner.register_parameter(leaf, p)
    return root


def whole_observer(
    mesh: StageMesh,
    module: nn.Module,
    layer_ids: tuple[int, ...],
    on_update: Callable[[int, nn.Module, list[tuple[torch.Tensor, torch.Tensor, int]]], None],
    shards: FlatShards | None = None,
) -> Callable[[int], None]:
    """``run_plan``'s ``on_update`` for a cut stage: the layers' whole weights and gradients
    (gathered at each ``OPT``: collective on the rank's tensor and replica groups), each layer a
    :func:`layer_module`, every parameter updated whole at offset 0."""

    def observe(step: int) -> None:
        weights = whole_layers(mesh, module, layer_ids, grads=False)
        grads = whole_layers(mesh, module, layer_ids, grads=True, shards=shards)
        whole = nn.Sequential(*(layer_module(weights[i], grads[i]) for i in layer_ids))
        on_update(step, whole, [(p, p, 0) for p in whole.parameters()])

    return observe


def tensor_programs(plan: Plan, schedule: dict[int, Any]) -> dict[int, Any]:
    """The lowered schedule (one program per tensor group's first device,
    :func:`dapple.schedule.lower.lower`) with every other rank of each tensor group running its
    group's program: the same F, B, AR and OPT, and sends and receives with the peers that
    :func:`peer_ranks` pairs it with."""
    out = dict(schedule)
    for st in plan.stages[: plan.num_groups]:
        for j in range(st.replicas if st.parallel.tensor_parallel else 0):
            first, *rest = st.tensor_group(j)
            for d in rest:
                out[d] = schedule.get(first, [])
    return out
