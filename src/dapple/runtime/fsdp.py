"""Sharded parameters (ZeRO-3) for a stage with PyTorch's FSDP2 ``fully_shard``.

The stage's parameters are cut over its replica mesh (``Shard(0)`` DTensors); the pipeline's
``M`` micro-batches run between one all-gather and one reduce-scatter per step:

- ``reshard_after_forward=False``: a forward keeps the whole parameters for its backward;
- micro-batches ``0 .. M-2`` neither reduce their gradients (``set_requires_gradient_sync``)
  nor reshard after backward (``set_reshard_after_backward``): they accumulate whole gradients
  locally, as dapple's ZeRO-0 replicas do, and the next forward needs no all-gather;
- micro-batch ``M-1`` reduce-scatters the accumulated gradients and reshards, so the optimizer
  steps on this rank's shard of parameters and gradients only.

Memory: whole parameters and whole gradients live from the first forward to the last backward
of a step (ZeRO-3's saving is then the optimizer state and the time between steps); re-gathering
per micro-batch instead (``regather=True``) keeps only shards between micro-batches, at the cost
of ``M`` all-gathers forward, ``M`` backward and ``M`` reduce-scatters per step. Which one a
stage gets is the planner's choice (issue 30).

Gradients are *summed* over the replicas (divide factor 1, plain ``SUM`` reductions: the factor
alone makes FSDP use ``PREMUL_SUM``, which gloo refuses): dapple scales each sample's loss by
``1 / G`` already (:mod:`dapple.models.workload`), so the sum is the global batch's gradient.
Pieces from :mod:`dapple.models.split` read their parameters with ``get_attr``, so only the
module whose ``forward`` runs can be an FSDP unit: wrap the stage (or each piece), not the
layers inside a piece.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from dapple.errors import ValidationError

__all__ = ["begin_micro_batch", "full_parameters", "shard_stage"]


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
    fully_shard(module, mesh=mesh, reshard_after_forward=regather)
    sharded: Any = module
    assert isinstance(sharded, FSDPModule)
    sharded.set_gradient_divide_factor(1.0)
    sharded.set_force_sum_reduction_for_comms(True)  # factor 1 alone is PREMUL_SUM: not on gloo
    return sharded


def begin_micro_batch(module: FSDPModule, m: int, M: int, *, regather: bool = False) -> None:
    """Before micro-batch ``m`` of ``M``'s forward: reduce-scatter and reshard only after the
    last backward of the step; with ``regather``, after every backward (nothing whole is kept
    between micro-batches: the gradients accumulate in their shards)."""
    each = regather or m == M - 1
    module.set_requires_gradient_sync(each)
    module.set_reshard_after_backward(each)


def full_parameters(module: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) whole over the replica mesh, as plain tensors (an
    all-gather per sharded parameter: call on every rank of the mesh)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p.detach()
        if t is not None:
            out[name] = t.full_tensor() if isinstance(t, DTensor) else t
    return out
