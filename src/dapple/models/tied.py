"""Tied parameters across pieces: find them, and sum their gradients over every copy.

A parameter the original model uses in two pieces (GPT-2's ``wte`` and ``lm_head``) becomes
one copy per piece after splitting (:mod:`dapple.models.split`). Training stays equal to the original
model if, after the backward passes and before the optimizer step, every copy's gradient is
replaced by the sum over all copies (and all copies start equal, which ``dapple.models.split``'s
per-seed construction guarantees). Pure torch; no process group here: the runtime passes the
cross-process sum as ``group_sum_fn``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from dapple.errors import ValidationError

__all__ = ["TiedGroups", "find_tied_parameters", "sum_tied_grads_local", "sync_tied_grads"]

TiedGroups = Sequence[Sequence[tuple[int, str]]]


def find_tied_parameters(pieces: Sequence[nn.Module]) -> list[list[tuple[int, str]]]:
    """Groups of ``(piece index, parameter name)`` that are one Parameter object in 2+ pieces.

    Call it on pieces that still share the original model's parameters (as
    :func:`split_module` returns them, before any copy). A parameter shared only inside one
    piece is not a group: autograd already sums its gradient.

    Args:
        pieces: The pieces, in chain order.
    """
    seen: dict[int, list[tuple[int, str]]] = {}
    for index, piece in enumerate(pieces):
        for pname, param in piece.named_parameters(remove_duplicate=True):
            seen.setdefault(id(param), []).append((index, pname))
    return [group for group in seen.values() if len({i for i, _ in group}) > 1]


def _param(module: nn.Module, name: str) -> nn.Parameter:
    return module.get_parameter(name)


def sync_tied_grads(
    stage_modules_by_layer: Mapping[int, nn.Module],
    groups: TiedGroups,
    group_sum_fn: Callable[[int, torch.Tensor], torch.Tensor],
) -> None:
    """Give every local copy of a tied parameter the gradient summed over all copies.

    Call it after the backward passes of a step and before the optimizer step. With data
    parallelism, either order relative to the replicas' AllReduce gives the same result (both
    are linear); the sum here is over the *stages* of one replica, never over replicas.

    Args:
        stage_modules_by_layer: Layer index -> this process's module of that layer (only the
            layers this process holds).
        groups: ``Workload.tied_parameters``.
        group_sum_fn: ``(group index, local sum) -> sum over every process holding a copy of
            that group``; called only for groups with a copy here (in group order), so all
            holders must call it for the same groups. Identity in one process.

    Raises:
        ValidationError: A tied copy has a different shape from its group's first local copy.
    """
    for g, group in enumerate(groups):
        params = [
            _param(stage_modules_by_layer[i], name)
            for i, name in group
            if i in stage_modules_by_layer
        ]
        if not params:
            continue
        shape = params[0].shape
        if any(p.shape != shape for p in params):
            raise ValidationError(f"tied group {g} {list(group)} mixes shapes")
        grads = [p.grad for p in params if p.grad is not None]
        # the local sum builds up in the first copy's gradient and the others are written in
        # place: no temporary the size of the parameter (GPT-2's embedding is a third of it)
        local = grads[0] if grads else torch.zeros_like(params[0])
        for grad in grads[1:]:
            local.add_(grad)
        total = group_sum_fn(g, local)
        for p in params:
            if p.grad is None:
                p.grad = total.clone()
            elif p.grad is not total:
                p.grad.copy_(total)


def sum_tied_grads_local(model_pieces: Sequence[nn.Module], groups: TiedGroups) -> None:
    """:func:`sync_tied_grads` when all pieces are in this process (``model_pieces[i]``).

    Args:
        model_pieces: Every layer of the workload in order (e.g. ``build_model(seed)``).
        groups: ``Workload.tied_parameters``.
    """
    sync_tied_grads(dict(enumerate(model_pieces)), groups, lambda _g, t: t)
