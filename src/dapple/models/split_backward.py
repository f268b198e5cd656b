"""A stage's backward in two halves, for zero-bubble schedules (``I`` then ``W``, Qi et al.).

``I`` (:func:`input_gradients`) computes the gradients of the stage's inputs - what the previous
stage waits for - and keeps, for each group of parameters, the gradients flowing into the
autograd nodes that lead to them; ``W`` (:func:`weight_gradients`) later turns those into the
parameters' gradients, one group at a time, accumulating into ``p.grad`` and telling
``on_ready`` about each parameter whose gradient of this micro-batch is complete, so the
replicas' gradient reduction can start while the remaining groups compute (it would otherwise
hear of them from autograd's post-accumulate hooks, which these halves bypass).

Both use ``torch.distributed.pipelining``'s own halves (``stage_backward_input`` and
``stage_backward_weight``, the ones its zero-bubble schedules run). A stage whose inputs carry
no gradient (the first stage) has nothing to split: its ``I`` does nothing and its ``W`` is the
whole backward (:class:`dapple.runtime.stage.StageExecutor`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dapple.errors import ValidationError

__all__ = [
    "ParamGroups",
    "input_gradients",
    "require_split_backward",
    "weight_gradients",
    "weight_nodes",
]

ParamGroups = list[dict[str, Any]]
"""What ``I`` leaves for ``W``: torch's parameter groups with their captured gradients."""


def require_split_backward(schedule: str) -> None:
    """Refuse, before any compute, a torch without the split backward ``schedule`` runs.

    Raises:
        ValidationError: ``torch.distributed.pipelining._backward`` lacks the two halves.
    """
    try:
        from torch.distributed.pipelining._backward import (  # noqa: F401
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError as e:
        raise ValidationError(
            f"schedule {schedule!r} needs torch's split backward "
            f"(torch.distributed.pipelining._backward, torch {torch.__version__} lacks it: {e}); "
            "use --schedule dapple"
        ) from e


def input_gradients(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[nn.Parameter],
) -> ParamGroups:
    """``I``: accumulate the gradients of ``inputs`` into their ``.grad`` (``outputs`` given
    ``output_grads``; None: ``outputs`` is the loss) and return what ``W`` needs.

    torch detaches ``outputs`` in place to free the graph above them, so they must not be
    views, which torch refuses to detach in place, nor leaves (an input passed through would be
    detached too): :class:`~dapple.runtime.stage.StageExecutor` copies those of its outputs in
    the forward. An output its own node saved (tanh's) is fine: the node keeps its own alias."""
    from torch.distributed.pipelining._backward import stage_backward_input

    _, groups = stage_backward_input(
        list(outputs),
        None if output_grads is None else list(output_grads),
        list(inputs),
        iter(weights),
    )
    return groups


def weight_nodes(weights: Sequence[nn.Parameter]) -> dict[Any, nn.Parameter]:
    """Each of ``weights`` by its gradient accumulator, the autograd node ``I``'s groups name
    it by. Holding the nodes keeps them the parameters' own from step to step (a parameter
    keeps only a weak reference to its accumulator), so the map can be built once."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    return {_get_grad_fn_or_grad_acc(p): p for p in weights}


def weight_gradients(
    groups: ParamGroups,
    weights: Sequence[nn.Parameter],
    on_ready: Callable[[torch.Tensor], None] | None = None,
    nodes: dict[Any, nn.Parameter] | None = None,
) -> None:
    """``W``: accumulate the gradients of ``weights`` from ``groups`` (:func:`input_gradients`'
    result for the same micro-batch), group by group; ``on_ready(p)`` after the last group that
    adds to ``p``. ``nodes``: :func:`weight_nodes` of ``weights``, built once and held (None:
    built here, a view per weight)."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    param_of = weight_nodes(weights) if nodes is None else nodes
    left = Counter(node for group in groups for node in group["params"])
    for group in groups:
        in_group = list(group["params"])
        mine = [param_of[node] for node in in_group]  # torch maps only the weights it is given
        stage_backward_weight(iter(mine), [group])
        if on_ready is None:
            continue
        for node, p in zip(in_group, mine, strict=True):
            left[node] -= 1
            if left[node] == 0:
                on_ready(p)
