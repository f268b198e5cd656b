"""Checkpoints of a cut stage (t_s > 1, ZeRO-3 or e_s > 1): whole layers out, this rank's
shards in.

A checkpoint stays layer-keyed and whole (:mod:`dapple.runtime.checkpoint`) whatever plan wrote
it, so a stage cut over a tensor group (:mod:`dapple.runtime.parallel.tp`) or sharded over its replicas
(FSDP2, :mod:`dapple.runtime.parallel.fsdp`) converts at the file boundary:

- **Save** (:meth:`CutStage.layer_states`): every parameter, buffer and tensor of the optimizer
  state (AdamW's ``exp_avg``, ``exp_avg_sq``; the scalar ``step`` is copied) is made whole the
  way :func:`dapple.runtime.parallel.stage_mesh.whole_parameters` makes a weight whole: a ZeRO-3 DTensor
  all-gathered over the replica group (``full_tensor``), an expert shard's ``E/e_s`` experts
  over its expert group (:mod:`dapple.runtime.parallel.expert`), then a cut tensor's ``t`` slices
  all-gathered over the tensor group and joined (:meth:`ShardLayout.unshard`). Collective on
  both groups, one layer at a time; only the stage's first device (replica 0, tensor rank 0)
  keeps the result and writes it, in the files an unsharded stage writes.
- **Resume** (:meth:`CutStage.restore`): every rank of the stage reads its layers whole, takes
  its tensor slice (:meth:`ShardLayout.shard`, the rule the cut used), its experts (an expert
  shard) and then its FSDP2 shard
  (``distribute_tensor`` with the parameter's own mesh and placements, sliced locally: no
  communication), and loads them into its parameters and optimizer state, re-keyed to the
  optimizer's parameter order as :func:`dapple.runtime.checkpoint.restore_stage` does.

So a checkpoint written under DP2 x TP2 resumes under 2:2 or 1:2 with ZeRO-3, and the other way
round, one written under EP 2 resumes without EP and the other way round, and ``dapple export``
reads it as any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dapple.runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    LayerState,
    check_layer_shapes,
    check_optimizer_type,
    load_layer_states,
    slice_state,
)
from dapple.runtime.parallel.stage_mesh import StageMesh
from dapple.runtime.parallel.tp.collectives import all_gather_list
from dapple.runtime.parallel.zero import FlatShards

__all__ = ["CutStage"]


@dataclass
class CutStage:
    """One rank's cut stage, as its checkpoints see it."""

    mesh: StageMesh
    """How the stage is cut (its TP module and layouts, its FSDP2 wrapping)."""
    module: nn.Module
    """The cut stage: its children are the chain's layers ``layer_ids``, holding this rank's
    slices (TP) or DTensor shards (ZeRO-3) under the whole model's names."""
    layer_ids: tuple[int, ...]
    writes: bool
    """This rank writes the stage's layers (replica 0, tensor rank 0)."""
    shards: FlatShards | None = None
    """ZeRO-1/2 over the replicas of the rank's tensor index: the optimizer updates this
    replica's pieces (:class:`~dapple.runtime.parallel.zero.FlatShards`) of the stage's slices."""

    def _resharded(self) -> None:
        """ZeRO-3: the sharded DTensor parameters registered (those the optimizer keys)."""
        for unit in self.mesh.fsdp_units():
            unit.reshard()  # type: ignore[operator]

    def _whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (parameter ``name``'s value or state) whole, on CPU. Collective."""
        local = t.full_tensor() if isinstance(t, DTensor) else t
        ep = self.mesh.experts
        if ep is not None and name in ep.names:
            local = ep.gather(local.detach())
        tp = self.mesh.tp
        if tp is not None and name in tp.layouts:
            local = tp.layouts[name].unshard(all_gather_list(local.detach(), tp.group))
        return local.detach().to("cpu", copy=True)

    def _mine(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole ``full`` for parameter ``name``, shaped as ``like`` (its
        tensor slice, then its shard of ``like``'s mesh). No communication."""
        tp = self.mesh.tp
        if tp is not None and name in tp.layouts:
            full = tp.layouts[name].shard(full, tp.rank, tp.t)
        ep = self.mesh.experts
        if ep is not None and name in ep.names:
            full = ep.mine(full)
        full = full.to(like.device, like.dtype)
        if isinstance(like, DTensor):
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
        return full

    def whole_shape(self, name: str, t: torch.Tensor) -> list[int]:
        """The whole shape of ``t`` (a DTensor's is already whole over the replicas)."""
        shape = list(t.shape)
        tp = self.mesh.tp
        if tp is not None and name in tp.layouts:
            lay = tp.layouts[name]
            shape[lay.dim] = sum(lay.parts)
        ep = self.mesh.experts
        if ep is not None and name in ep.names:
            shape[0] *= ep.coll.size
        return shape

    def _layers(self) -> list[tuple[int, str, nn.Module]]:
        """``(chain index, qualified prefix, layer)`` of each child."""
        kids = list(self.module.children())
        if len(kids) != len(self.layer_ids):
            raise ValueError(f"{len(self.layer_ids)} layer indices for {len(kids)} layers")
        return [(i, f"{k}.", c) for k, (i, c) in enumerate(zip(self.layer_ids, kids, strict=True))]

    # -- save ----------------------------------------------------------------------------------
    def layer_states(self, optimizer: torch.optim.Optimizer | None) -> dict[int, LayerState]:
        """Every layer whole (tensors and optimizer state); empty on every rank but the writer.

        Under ZeRO-1/2 (:attr:`shards`) the optimizer pieces are first gathered to replica 0
        over the replica group (an expert shard's, at e_s < r_s, over its copies to the one in
        expert group 0); its tensor ranks then join the slices, and with expert shards every
        replica holding its experts' state joins their gathers (in name order): at e_s < r_s
        under ZeRO, expert group 0 only. Collective over the stage's tensor, replica, expert
        and copy groups (every rank of the stage calls it, in the same order).
        """
        self._resharded()
        gathered = None
        if self.shards is not None:
            gathered = self.shards.layer_states(self.layer_ids, optimizer)
            if not gathered and self.mesh.experts is None:  # a replica other than 0
                return {}
            gathered = gathered or None  # the others join the expert group's gathers
        dev = next(self.module.parameters()).device
        out: dict[int, LayerState] = {}
        for i, prefix, layer in self._layers():
            tensors = {n: self._whole(prefix + n, v) for n, v in layer.state_dict().items()}
            if gathered is not None:  # on the CPU, the same names in the same order everywhere
                states = sorted(gathered[i].optimizer.items())
            else:  # by name too: the gathers of the expert group pair by order
                states = sorted(((n, optimizer.state[p]) for n, p in layer.named_parameters()
                                 if optimizer is not None and optimizer.state.get(p)),
                                key=lambda x: x[0])  # fmt: skip
            opt = {
                n: {k: self._state_whole(prefix + n, _on(v, dev)) for k, v in sorted(st.items())}
                for n, st in states
            }
            if self.writes:
                out[i] = LayerState(i, tensors, opt)
        return out

    def _state_whole(self, name: str, v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            return self._whole(name, v)
        return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v

    # -- resume --------------------------------------------------------------------------------
    def restore(self, ckpt: Checkpoint, optimizer: torch.optim.Optimizer | None) -> None:
        """Load this rank's parts of the stage's layers and optimizer state from ``ckpt``.

        Raises:
            CheckpointError: a layer's tensor names or whole shapes differ from the checkpoint's,
                the optimizer class differs, a layer file is damaged, or optimizer state is
                missing for a parameter the optimizer updates.
        """
        self._resharded()
        layers = self._layers()
        for i, prefix, layer in layers:
            want = {n: self.whole_shape(prefix + n, v) for n, v in layer.state_dict().items()}
            check_layer_shapes(ckpt, i, want)
        if optimizer is not None:
            check_optimizer_type(ckpt, type(optimizer).__name__)
        states = load_layer_states(ckpt, [i for i, _, _ in layers])
        by_param: dict[int, tuple[str, dict[str, Any]]] = {}
        for i, prefix, layer in layers:
            own = layer.state_dict()
            mine = {n: self._mine(prefix + n, states[i].tensors[n], v) for n, v in own.items()}
            layer.load_state_dict(mine)
            for n, p in layer.named_parameters():
                if n in states[i].optimizer:
                    by_param[id(p)] = (prefix + n, states[i].optimizer[n])
        if optimizer is not None:
            self._load_optimizer(ckpt, optimizer, by_param)

    def _load_optimizer(
        self,
        ckpt: Checkpoint,
        optimizer: torch.optim.Optimizer,
        by_param: Mapping[int, tuple[str, dict[str, Any]]],
    ) -> None:
        sd = optimizer.state_dict()
        sd["state"] = {}
        names = {id(p): n for n, p in self.module.named_parameters()}
        views = self.shards.views() if self.shards is not None else {}
        order = [p for g in optimizer.param_groups for p in g["params"]]
        for k, p in enumerate(order):
            origin, offset = views.get(id(p), (p, -1))  # a ZeRO-1/2 piece: its origin's slice
            found = by_param.get(id(origin))
            if found is None:
                if by_param and p.requires_grad:
                    raise CheckpointError(
                        f"checkpoint {str(ckpt.manifest_path)!r} is incomplete: parameter "
                        f"{names.get(id(origin), '?')!r} has no optimizer state"
                    )
                continue
            name, st = found
            mine = {
                key: self._mine(name, v, origin)
                if isinstance(v, torch.Tensor) and v.ndim > 0 else v
                for key, v in st.items()
            }  # fmt: skip
            sd["state"][k] = mine if offset < 0 else slice_state(mine, offset, p.numel())
        optimizer.load_state_dict(sd)


def _on(v: Any, dev: torch.device) -> Any:
    """A non-scalar tensor of optimizer state moved to ``dev`` (for the tensor group's
    gather); anything else as it is."""
    return v.to(dev) if isinstance(v, torch.Tensor) and v.ndim > 0 else v
