"""Expert parallelism (EP) inside a replicated stage: each MoE layer's experts sharded over the
stage's expert groups (``StagePlan.expert_width`` e_s), everything else replicated.

Stage ``s`` has r_s replicas; consecutive replicas ``[k*e, (k+1)*e)`` form expert group ``k``,
which holds every expert once: replica ``j`` holds expert shard ``j % e`` (experts
``[(j%e)*E/e, (j%e+1)*E/e)`` of every MoE layer, under the whole model's parameter names).

- **Forward.** Each replica computes its own slice of every micro-batch as without EP: router,
  top-k, sorting by expert. At each MoE site (:mod:`.sites`: a traced grouped-matmul experts
  block) its token rows go to the replicas of its expert group that hold their experts and the
  results come back (:mod:`.exchange`: an all-to-all each way, dropless, on gloo and NCCL).
- **Backward.** The exchanges' backwards move the gradients the same way; an expert shard's
  gradient holds the contributions of every token of its expert group routed to it.
- **Gradients.** Non-expert parameters: the stage AllReduce over all r_s replicas, as today
  (:class:`~dapple.runtime.sync.GradientSync`). Expert shards: left out of it, and summed over
  the r_s/e_s replicas holding the same shard (``StagePlan.expert_shard_replicas``) at the
  ``AR`` action (:class:`ExpertGradientSync`; nothing to sum when e_s = r_s). Every loss is
  already scaled by its rows over the global batch, so these sums equal one device's gradient.
- **Load.** Each MoE layer's tokens per expert per step, counted on the device before the
  dispatch and summed over the ranks in the step's collective (:mod:`.load`).
- **Norm, verify, checkpoints.** Replica 0 counts the non-expert parameters in the global
  gradient norm and the replicas of expert group 0 their expert shards; whole weights (for
  ``dapple verify``) and whole checkpoints (weights and optimizer state,
  :class:`~dapple.runtime.parallel.sharded_state.CutStage`) are all-gathered over the expert
  group (:meth:`ExpertShards.gather`); a resume takes each member's shard of the whole tensors
  (:meth:`ExpertShards.mine`), so a checkpoint resumes under any expert width.

- **ZeRO-1/2**: the non-expert parameters are sharded over the r_s replicas as without EP
  (:mod:`dapple.runtime.parallel.zero`). At e_s = r_s the expert shards stay out of the flat
  buckets (:func:`~dapple.runtime.parallel.zero.select_zero`), each replica updating its own E/e_s
  experts whole - no other replica holds them. Below (e_s < r_s) they go into buckets of their
  own, sharded over the r_s/e_s replicas holding the same shard
  (:class:`~dapple.runtime.parallel.zero.ShardGroup`): reduce-scattered and gathered over those
  instead of this module's AllReduce, each copy keeping ``e_s/r_s`` of their optimizer state
  (ZeRO-2: and gradients); a checkpoint gathers their state to the shard's replica in expert
  group 0 first.

Refused before any compute (:func:`check_expert_run`): e_s > 1 with tensor parallelism, ZeRO-3,
an interleaved plan (several chunks per device) or fp16 loss scaling; and, before any worker
starts (:func:`check_expert_layers`, on the traced pieces' templates), a stage without MoE
experts of this shape, or E not a multiple of e_s (a workload not traced: once the stage is
built, by :func:`shard_experts`).
Re-computation and split-backward schedules (``I`` then ``W``) run: the exchanges are re-run
or back-propagated in the same order on every replica of the stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from dapple.core.plan import Plan
from dapple.core.precision import precision_of
from dapple.errors import ValidationError
from dapple.models.split import piece_template
from dapple.models.workload import Workload
from dapple.runtime import comm
from dapple.runtime.parallel.expert.exchange import GroupCollectives
from dapple.runtime.parallel.expert.load import ExpertLoads, count_expert_load, expert_report
from dapple.runtime.parallel.expert.sites import find_sites, shard_site, site_experts
from dapple.runtime.sync import GradientSync
from dapple.runtime.train_config import TrainConfig

__all__ = [
    "ExpertGradientSync",
    "ExpertGroups",
    "ExpertLoads",
    "ExpertShards",
    "check_expert_layers",
    "check_expert_run",
    "count_expert_load",
    "expert_report",
    "gradient_sync",
    "make_expert_groups",
    "shard_experts",
]


def _expert_stages(plan: Plan) -> list[int]:
    return [s for s, st in enumerate(plan.stages) if st.parallel.expert_parallel]


def check_expert_run(plan: Plan, config: TrainConfig) -> None:
    """Refuse, before any compute, what expert parallelism does not run (``plan`` with the
    run's zero stage floored in, :func:`~dapple.runtime.parallel.stage_mesh.zero_floored`).

    Raises:
        ValidationError: one line naming the stage and what is unsupported.
    """
    for s in _expert_stages(plan):
        st = plan.stages[s]
        what = f"stage {s} {list(st.layers)} (expert_width {st.expert_width})"
        refusals = [
            (st.parallel.tensor_parallel, f"tensor_width {st.tensor_width}: EP with TP"),
            (st.parallel.shards_params, "zero_stage 3: EP with ZeRO-3"),
            (plan.num_groups < plan.num_stages, "an interleaved plan"),
            (precision_of(config.precision).loss_scaling, f"precision {config.precision}"),
        ]  # fmt: skip
        for bad, reason in refusals:
            if bad:
                raise ValidationError(f"{what}: expert parallelism with {reason} is not supported")


def check_expert_layers(plan: Plan, workload: Workload) -> None:
    """Refuse, before any worker starts, a stage of e_s > 1 whose layers hold no MoE block
    expert parallelism can cut, or whose experts e_s does not divide: read off the traced
    pieces' templates (:func:`~dapple.models.split.piece_template`, parameters on ``meta``), as
    :func:`shard_experts` finds them (a layer not traced holds none).

    Raises:
        ValidationError: one line naming the plan stage, its width and the model.
    """
    for s in _expert_stages(plan):
        st = plan.stages[s]
        e, (a, b) = st.expert_width, st.layers
        # as shard_experts: the sites of the traced pieces (a layer built whole has none)
        pieces = [
            p for i in range(a, b) if isinstance(p := piece_template(workload, i), fx.GraphModule)
        ]
        what = f"plan stage {s} {list(st.layers)} (expert_width {e})"
        experts = [site_experts(p, site) for p in pieces for site in find_sites(p)]
        if not experts:
            raise ValidationError(
                f"{what}: model {workload.name!r} has no mixture-of-experts layers there that "
                "expert parallelism can shard (traced grouped-matmul experts, as Mixtral's and "
                "Qwen2-MoE's); plan the stage with expert_width 1"
            )
        bad = sorted({E for E in experts if E % e})
        if bad:
            raise ValidationError(
                f"{what}: model {workload.name!r}'s MoE layers there hold "
                f"{', '.join(map(str, bad))} experts, not a multiple of {e}"
            )


# -- process groups -------------------------------------------------------------------------
@dataclass
class ExpertGroups:
    """The expert and expert-shard groups of a plan (created on every rank, in one order)."""

    group: dict[tuple[int, int], Any] = field(default_factory=dict)
    """``(stage, k)`` -> the group of expert group k's replicas (stages with e_s > 1)."""
    shard: dict[tuple[int, int], Any] = field(default_factory=dict)
    """``(stage, i)`` -> the group of the replicas holding shard i (r_s / e_s > 1)."""

    def all(self) -> list[Any]:
        """Every group, in creation order."""
        return [*self.group.values(), *self.shard.values()]


def make_expert_groups(plan: Plan) -> ExpertGroups:
    """Create every stage's expert groups, then its shard groups. Collective (every rank)."""
    out = ExpertGroups()
    for s in _expert_stages(plan):
        st = plan.stages[s]
        e, dev = st.expert_width, st.replica_devices
        for k in range(st.replicas // e):
            out.group[(s, k)] = dist.new_group([dev[j] for j in st.expert_group(k * e)])
        if st.replicas > e:
            for i in range(e):
                out.shard[(s, i)] = dist.new_group([dev[j] for j in st.expert_shard_replicas(i)])
    return out


# -- the rank's shards ----------------------------------------------------------------------
@dataclass
class ExpertShards:
    """One rank's expert shards and how its groups reduce, gather and count them."""

    coll: GroupCollectives
    """Its expert group (``index``: the shard it holds)."""
    shard_pg: Any
    """The group of the replicas holding the same shard (None: e_s = r_s, nobody else)."""
    names: tuple[str, ...]
    """The shards' names in the rank's module (``piece.dotted.name``)."""
    params: list[nn.Parameter]
    """The shards, in :attr:`names` order."""
    counted: bool
    """The rank belongs to expert group 0: its shards count in the global gradient norm."""

    @property
    def param_ids(self) -> frozenset[int]:
        return frozenset(id(p) for p in self.params)

    def reduce_grads(self, skip: frozenset[int] = frozenset()) -> None:
        """Sum each shard's gradient over the replicas holding it (one flat AllReduce), but
        those in ``skip`` (ZeRO-1/2 reduce-scatters them over the same replicas)."""
        params = [p for p in self.params if id(p) not in skip]
        if self.shard_pg is None or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.shard_pg)
        off = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[off : off + g.numel()].view_as(p).clone()
            off += g.numel()

    def whole(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``local`` (tensors by name) with each shard replaced by the whole ``[E, ...]``
        tensor, gathered over the expert group. Collective."""
        out = dict(local)
        for name in self.names:
            out[name] = self.gather(local[name].detach())
        return out

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The whole ``[E, ...]`` tensor of which ``t`` is this member's ``[E/e, ...]`` shard (a
        weight, its gradient or its optimizer state), gathered over the expert group.
        Collective."""
        parts = self.coll.all_gather(t)
        return parts.reshape(-1, *parts.shape[2:])

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        """This member's ``[E/e, ...]`` shard of the whole ``[E, ...]`` tensor ``full``."""
        n = full.shape[0] // self.coll.size
        return full[self.coll.index * n : (self.coll.index + 1) * n]

    def norm_counted(self, module: nn.Module, replica: int) -> list[nn.Parameter]:
        """This rank's parameters in the global gradient norm: the non-expert ones on replica
        0, its shards on the replicas of expert group 0."""
        ids = self.param_ids
        dense = [p for p in module.parameters() if id(p) not in ids] if replica == 0 else []
        return dense + (self.params if self.counted else [])


def shard_experts(
    plan: Plan, rank: int, module: nn.Module | None, groups: ExpertGroups
) -> ExpertShards | None:
    """Cut the MoE sites of ``rank``'s stage for its expert shard, in place (None: e_s = 1).

    Raises:
        ValidationError: the stage holds no MoE site, a site is not of the shape EP cuts, or
            its experts are not a multiple of e_s (before any compute).
    """
    if module is None or rank not in plan.devices:
        return None
    s, j = plan.stage_of_device(rank)
    st = plan.stages[s]
    if not st.parallel.expert_parallel:
        return None
    e = st.expert_width
    coll = GroupCollectives(groups.group[(s, j // e)], e, j % e)
    names: list[str] = []
    for i, piece in enumerate(module.children()):
        if not isinstance(piece, fx.GraphModule):
            continue
        sites = find_sites(piece)
        for n, site in enumerate(sites):
            names += [f"{i}.{w}" for w in shard_site(piece, site, coll, f"dapple_expert_{n}")]
        if sites:
            piece.recompile()
    if not names:
        raise ValidationError(
            f"stage {s} {list(st.layers)}: expert_width {e}, but its layers hold no mixture-of-"
            "experts block expert parallelism can shard (traced grouped-matmul experts)"
        )
    params = [module.get_parameter(n) for n in names]
    return ExpertShards(coll, groups.shard.get((s, j % e)), tuple(names), params, j < e)


class ExpertGradientSync(GradientSync):
    """:class:`GradientSync` leaving the expert shards out of the stage AllReduce and summing
    them over their shard's replicas at ``AR`` (:meth:`finish`)."""

    def __init__(self, *args: Any, experts: ExpertShards, **kwargs: Any) -> None:
        exclude = frozenset(kwargs.get("exclude", frozenset()))
        kwargs["exclude"] = exclude | experts.param_ids
        super().__init__(*args, **kwargs)
        self.experts = experts
        self.zero_sharded = exclude & experts.param_ids
        """The shards ZeRO-1/2 reduce-scatters over their copies (e_s < r_s): not summed here."""

    def finish(self) -> None:
        super().finish()
        self.experts.reduce_grads(self.zero_sharded)


def gradient_sync(experts: ExpertShards | None, *args: Any, **kwargs: Any) -> GradientSync:
    """The rank's :class:`GradientSync` (an :class:`ExpertGradientSync` with expert shards)."""
    if experts is None:
        return GradientSync(*args, **kwargs)
    return ExpertGradientSync(*args, experts=experts, **kwargs)
