"""Sharded parameters (ZeRO-3) for a stage with PyTorch's FSDP2 ``fully_shard``.

The stage's parameters are cut over its replica mesh (``Shard(0)`` DTensors); the pipeline's
``M`` micro-batches run between one all-gather and one reduce-scatter per step:

- ``reshard_after_forward=False``: a forward keeps the whole parameters for its backward;
- micro-batches ``0 .. M-2`` neither reduce their gradients (``set_requires_gradient_sync``)
  nor reshard after backward (``set_reshard_after_backward``): they accumulate whole gradients
  locally, as dapple's ZeRO-0 replicas do, and the next forward needs no all-gather;
- micro-batch ``M-1`` reduce-scatters the accumulated gradients and reshards, so the optimizer
  steps on this rank's shard of parameters and gradients only;
- under a split backward (ZB-H1: ``I`` then ``W``) no backward reduces
  (:func:`hold_gradients`): the step's last ``W`` runs FSDP2's post-backward by hand
  (:func:`reduce_gradients`).

Memory: whole parameters and whole gradients live from the first forward to the last backward
of a step (ZeRO-3's saving is then the optimizer state and the time between steps); re-gathering
per micro-batch instead (``regather=True``) makes each piece an FSDP unit of its own (the stage
the root), so only the running piece's parameters are whole and the gradients accumulate in
their shards, at the cost of ``M`` all-gathers forward, ``M`` backward and ``M``
reduce-scatters per step and piece. Which one a
stage gets is the planner's choice (issue 30).

Gradients are *summed* over the replicas (divide factor 1, plain ``SUM`` reductions: the factor
alone makes FSDP use ``PREMUL_SUM``, which gloo refuses): dapple scales each sample's loss by
``1 / G`` already (:mod:`dapple.models.workload`), so the sum is the global batch's gradient.
Pieces from :mod:`dapple.models.split` read their parameters with ``get_attr``, so only the
module whose ``forward`` runs can be an FSDP unit: wrap the stage (or each piece), not the
layers inside a piece.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from dapple.errors import ValidationError

__all__ = [
    "begin_micro_batch",
    "full_parameters",
    "hold_gradients",
    "reduce_gradients",
    "shard_stage",
]


def shard_stage(module: nn.Module, mesh: DeviceMesh, *, regather: bool = False) -> FSDPModule:
    """Cut ``module``'s parameters over the replica mesh ``mesh`` (in place; returns it).

    Args:
        module: A stage (an ``nn.Sequential`` of pieces) or one piece; plain parameters (those
            of a tensor-parallel piece are its local slices, so TP x FSDP composes).
        mesh: The stage's 1-D replica mesh (``r_s`` ranks).
        regather: All-gather before every micro-batch's forward and backward instead of once
            per step.

    Raises:
        ValidationError: a mesh of one rank (nothing to shard) or not 1-D.
    """
    if mesh.ndim != 1 or mesh.size() < 2:
        raise ValidationError(
            f"ZeRO-3 needs a 1-D replica mesh of at least 2 ranks, got shape {tuple(mesh.shape)}"
        )
    _forget_earlier_meshes()
    # A stage's output is often a view (a reshape); FSDP2 warns that an in-place op on it would
    # skip its pre-backward hook. The executor never changes an output in place (the split
    # backward detaches a clone), so the warning says nothing here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    if regather:  # one unit per piece: only the running piece's parameters are whole
        for piece in module.children():
            if any(True for _ in piece.parameters()):
                fully_shard(piece, mesh=mesh, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, reshard_after_forward=regather)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # factor 1 alone: PREMUL_SUM, no gloo
    sharded: Any = module
    assert isinstance(sharded, FSDPModule)
    return sharded


def _forget_earlier_meshes() -> None:
    """Clear DTensor's sharding-propagation caches (torch 2.13).

    They key a ``DeviceMesh`` by its ranks (``DeviceMesh.__eq__`` ignores the process group), so
    in a process that ran an earlier stage over the same ranks, the parameters ``fully_shard``
    makes (and every DTensor computed from them) would carry that run's mesh, whose destroyed
    group fails the first DTensor collective (``full_tensor``: "Could not resolve the process
    group").
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]


def begin_micro_batch(module: FSDPModule, m: int, M: int, *, regather: bool = False) -> None:
    """Before micro-batch ``m`` of ``M``'s forward: reduce-scatter and reshard only after the
    last backward of the step; with ``regather``, after every backward (nothing whole is kept
    between micro-batches: the gradients accumulate in their shards)."""
    each = regather or m == M - 1
    module.set_requires_gradient_sync(each)
    module.set_reshard_after_backward(each)


def hold_gradients(module: FSDPModule) -> None:
    """Split backward (``I`` then ``W``): no backward of the step reduce-scatters or reshards;
    the whole gradients accumulate until :func:`reduce_gradients` (FSDP2's hooks fire when ``I``
    reaches the stage's inputs, before ``W`` has computed any weight gradient)."""
    module.set_is_last_backward(False)
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)


def reduce_gradients(module: FSDPModule) -> None:
    """After the step's last ``W``: reduce-scatter the accumulated gradients and reshard, by
    running FSDP2's post-backward by hand (as ``torch.distributed.pipelining``'s
    ``perform_reduce_grad`` does for its zero-bubble schedules)."""
    module.set_is_last_backward(True)
    module.set_requires_gradient_sync(True)
    module.set_reshard_after_backward(True)
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def full_parameters(module: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) whole over the replica mesh, as plain tensors (an
    all-gather per sharded parameter: call on every rank of the mesh)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p.detach()
        if t is not None:
            out[name] = t.full_tensor() if isinstance(t, DTensor) else t
    return out
