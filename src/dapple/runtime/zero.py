"""Sharded optimizer state inside a replicated stage (ZeRO-1, per stage).

DAPPLE replicates stage ``s`` on ``r_s`` devices and all-reduces its gradients, AR(P_s, g_s);
without sharding every replica then runs the same optimizer update on the whole stage and
keeps the whole optimizer state (Adam: two fp32 moments, 8 of the 16 bytes per parameter).
With ``TrainConfig.zero_stage = 1`` (every replicated stage) or ``StagePlan.zero_stage = 1``
(that stage, as ``dapple plan --zero-stage 1`` records it) each replica of a stage with
``r_s > 1`` owns about ``1/r_s`` of the stage's parameters (:func:`partition`), keeps optimizer
state for those only and updates only them; then every owner broadcasts its updated parameters
to the other replicas of the stage (:meth:`StageShards.gather`, the ``OPT`` action's last part).

Design choices:
    - Shards are whole parameters (as ``torch.distributed.optim.ZeroRedundancyOptimizer``):
      the optimizer is the ordinary per-parameter one over the owned parameters, so the
      update of every element is bit-for-bit the unsharded one, the checkpoint stays keyed by
      layer and parameter name, and weight-decay groups (:func:`dapple.runtime.optim.decays`)
      stay per parameter. Owners are assigned greedily in parameter order to the replica with
      the fewest owned elements so far: deterministic, the same on every replica.
    - Gradient synchronisation stays the overlapped bucket AllReduce of
      :mod:`dapple.runtime.sync` (each replica then holds the whole reduced gradient), not a
      reduce-scatter: it moves ``2 (r-1)/r`` of the gradient bytes where a reduce-scatter
      would move ``(r-1)/r``, plus the parameter gather's ``(r-1)/r`` - 1.5x the wire bytes
      of ZeRO's reduce-scatter + all-gather. In exchange the global gradient norm, clipping,
      fp16 unscaling and the non-finite guard see the same full gradients as without sharding
      (each element counted once, by replica 0), and shards of whole parameters (of unequal
      sizes) need no flat, evenly split buffer. (torch 2.13's gloo does run
      ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` on CPU tensors; a flat-shard
      variant could use them.)
    - The gather broadcasts every parameter of at least :data:`GATHER_RUN_BYTES` straight
      into its own storage, and smaller ones (biases, norms) in flat runs of about that size;
      all broadcasts start at once (asynchronous) and are waited for together. So the gather
      adds at most the flat runs of small parameters to the peak memory, not a bucket.
    - Checkpoints stay complete and layer-keyed: at a save every replica sends the optimizer
      state of the parameters it owns to replica 0 (:meth:`StageShards.layer_states`), which
      writes the layer files as before; at a resume each replica's optimizer, built over its
      own parameters, takes only their state from the file (so a checkpoint saved under any
      plan or zero stage resumes under any other).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple.core.plan import Plan
from dapple.runtime.checkpoint import LayerState, stage_layer_states
from dapple.runtime.optim_config import ZERO_STAGES

__all__ = ["GATHER_RUN_BYTES", "ZERO_STAGES", "StageShards", "partition", "unsharded_stages"]

logger = logging.getLogger(__name__)

GATHER_RUN_BYTES = 2**20
"""Parameters this size or larger are broadcast in place; smaller ones in flat runs of up to
this many bytes (few collectives for many biases, little extra memory)."""


def partition(sizes: list[int], replicas: int) -> list[int]:
    """The owning replica of each parameter: greedy, in order, to the least-loaded replica.

    Args:
        sizes: element count of each parameter, in the stage's parameter order.
        replicas: r_s.

    Returns:
        ``owner[k]`` in ``range(replicas)`` for parameter ``k`` (ties: the lowest replica).
    """
    load = [0] * replicas
    owner = []
    for n in sizes:
        j = min(range(replicas), key=lambda i: (load[i], i))
        owner.append(j)
        load[j] += n
    return owner


def unsharded_stages(plan: Plan) -> list[int]:
    """The stages a zero stage does not change: those with one replica."""
    return [i for i, st in enumerate(plan.stages) if st.replicas == 1]


class StageShards:
    """One replica's shard of its stage's optimizer state and the parameter gather.

    Args:
        plan: the plan.
        stage: s, a stage with ``r_s > 1``.
        replica: j, this rank's replica of the stage.
        module: the stage's layers.
        pg: the stage's replica group (:attr:`GradientSync.pg`).
        bucket_bytes: the largest flat broadcast run (default :data:`GATHER_RUN_BYTES`).
    """

    def __init__(
        self,
        plan: Plan,
        stage: int,
        replica: int,
        module: nn.Module,
        pg: Any,
        *,
        bucket_bytes: int | None = None,
    ) -> None:
        self.devices = list(plan.stages[stage].devices)
        self.replica, self.module, self.pg = replica, module, pg
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.owner = partition([p.numel() for p in self.params], len(self.devices))
        self.owned = [p for p, j in zip(self.params, self.owner, strict=True) if j == replica]
        """The parameters this replica updates (its optimizer's)."""
        cap = GATHER_RUN_BYTES if bucket_bytes is None else bucket_bytes
        self.runs: list[tuple[int, list[nn.Parameter]]] = []
        """``(owner, parameters)``: the broadcasts of a gather, in order (every replica)."""
        for j in range(len(self.devices)):
            mine = [p for p, o in zip(self.params, self.owner, strict=True) if o == j]
            size = 0
            for p in mine:
                nbytes = p.numel() * p.element_size()
                last = self.runs[-1] if self.runs else None
                if (
                    last is None
                    or last[0] != j
                    or size + nbytes > cap
                    or (last[1][-1].dtype, last[1][-1].device) != (p.dtype, p.device)
                ):
                    self.runs.append((j, []))
                    size = 0
                self.runs[-1][1].append(p)
                size += nbytes

    def owned_fraction(self) -> float:
        """The share of the stage's parameter elements this replica owns."""
        total = sum(p.numel() for p in self.params)
        return sum(p.numel() for p in self.owned) / total if total else 0.0

    @torch.no_grad()
    def gather(self) -> None:
        """After the owners' update: every parameter takes its owner's value (broadcasts over
        the stage's replica group, started in the same order on every replica, then waited
        for together)."""
        pending: list[tuple[Any, torch.Tensor | None, bool, list[nn.Parameter]]] = []
        for j, ps in self.runs:
            src = self.devices[j]
            if len(ps) == 1 and ps[0].is_contiguous():
                work = dist.broadcast(ps[0].data, src=src, group=self.pg, async_op=True)
                pending.append((work, None, False, ps))
                continue
            if j == self.replica:
                flat = torch.cat([p.detach().reshape(-1) for p in ps])
            else:
                flat = torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype,
                                   device=ps[0].device)  # fmt: skip
            work = dist.broadcast(flat, src=src, group=self.pg, async_op=True)
            pending.append((work, flat, j != self.replica, ps))  # the buffer lives until waited
        for work, buf, receive, ps in pending:
            work.wait()
            if receive and buf is not None:
                off = 0
                for p in ps:
                    p.copy_(buf[off : off + p.numel()].view_as(p))
                    off += p.numel()

    def layer_states(
        self, first_layer: int, optimizer: torch.optim.Optimizer | None
    ) -> dict[int, LayerState]:
        """The stage's layer states with the WHOLE optimizer state on replica 0 (``{}`` on the
        others). A collective over the stage's replica group: every replica calls it.

        Args:
            first_layer: chain index of the stage's first layer.
            optimizer: this replica's optimizer (over :attr:`owned`).
        """
        if self.replica == 0:
            mine = stage_layer_states(self.module, first_layer, optimizer)
            shard = {}
        else:
            shard = _owned_state(self.module, first_layer, optimizer)
        got: list[Any] = [None] * len(self.devices) if self.replica == 0 else []
        dist.gather_object(
            shard, got if self.replica == 0 else None, dst=self.devices[0], group=self.pg
        )
        if self.replica != 0:
            return {}
        for other in got[1:]:
            for i, opt in other.items():
                mine[i].optimizer.update(opt)
        return mine


def _owned_state(
    module: nn.Module, first_layer: int, optimizer: torch.optim.Optimizer | None
) -> dict[int, dict[str, dict[str, Any]]]:
    """``{layer: {parameter name: CPU copy of its optimizer state}}`` for the parameters with
    state in ``optimizer``."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    if optimizer is None:
        return out
    for i, layer in enumerate(module.children()):
        for name, p in layer.named_parameters(remove_duplicate=False):
            st = optimizer.state.get(p)
            if st:
                out.setdefault(first_layer + i, {})[name] = {
                    k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in st.items()
                }
    return out
