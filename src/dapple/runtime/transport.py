"""Stage-boundary transport: boundary shapes, split-concat point-to-point messages (section 6.2).

A boundary value is one tensor or a tuple of tensors with the batch in dimension 0. Receivers
must know what arrives before posting ``irecv``, so at set-up the runtime runs a *shape probe*
(:func:`infer_boundary_specs`): replica 0 of stage 0 runs its layers on one real sample and
sends the (1-sample) result to replica 0 of stage 1 with ``send_object_list``, which does the
same, down the pipeline; then every rank learns every boundary's :class:`BoundarySpec` with one
``all_gather_object``. This runs the real layers (no meta-device support needed) once, in eval
mode and without gradients, so it changes no parameter or running statistic. It assumes a
boundary tensor's per-sample shape does not depend on the batch size. Under mixed precision
the runtime calls it inside the stages' autocast (:mod:`dapple.runtime.precision`), so a spec
carries the dtype autocast produces (e.g. bf16) and the receivers' buffers match what is sent.

Messages between the same pair of ranks are tagged by (micro-batch, direction, tensor index);
only floating-point boundary tensors carry gradients backwards.

Shapes that change from step to step (a model with dynamic input dimensions,
:mod:`dapple.models.shapes`): the probe still fixes each boundary tensor's dtype and rank, and
every activation message is preceded by a *shape header* - one int64 tensor holding the
per-sample sizes of the message's tensors (:func:`shape_header`, tag index
:data:`HEADER_INDEX`) - from which the receiver sizes its buffers (:func:`sample_shapes`).
Gradients need no header: their shape is that of the activations the receiving stage sent.
Models without a dynamic dimension keep the static path (buffers from the spec, no header).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple.core.plan import Plan

__all__ = [
    "HEADER_INDEX",
    "BoundarySpec",
    "TensorSpec",
    "flatten",
    "header_buffer",
    "infer_boundary_specs",
    "message_tag",
    "sample_shapes",
    "shape_header",
    "unflatten",
]

HEADER_INDEX = 63
"""Tag index (see :func:`message_tag`) of a message's shape header; tensors use 0 .. 62."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """dtype and per-sample shape (without the batch dimension) of one boundary tensor."""

    dtype: torch.dtype
    sample_shape: tuple[int, ...]

    @property
    def carries_grad(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty((rows, *self.sample_shape), dtype=self.dtype, device=device)


@dataclass(frozen=True, slots=True)
class BoundarySpec:
    """What crosses one stage boundary: a single tensor or a tuple of tensors."""

    is_tuple: bool
    tensors: tuple[TensorSpec, ...]

    @staticmethod
    def of(value: Any) -> BoundarySpec:
        flat = flatten(value)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise TypeError(
                    "stage boundary values must be tensors (or tuples of tensors) with the batch "
                    f"in dimension 0, got {type(t).__name__}"
                    + (" of dim 0" if isinstance(t, torch.Tensor) else "")
                )
        if len(flat) > HEADER_INDEX:
            raise TypeError(
                f"a stage boundary carries {len(flat)} tensors; at most {HEADER_INDEX} fit the "
                "message tags"
            )
        return BoundarySpec(
            is_tuple=isinstance(value, (tuple, list)),
            tensors=tuple(TensorSpec(t.dtype, tuple(t.shape[1:])) for t in flat),
        )


def flatten(value: Any) -> tuple[Any, ...]:
    """A boundary value as a tuple of its tensors."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def unflatten(spec_is_tuple: bool, tensors: Sequence[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`."""
    return tuple(tensors) if spec_is_tuple else tensors[0]


def message_tag(micro_batch: int, backward: bool, index: int, boundary: int = 0) -> int:
    """Tag of tensor ``index`` of micro-batch ``micro_batch``'s activations (or gradients) at
    stage boundary ``boundary`` (the output of that stage): two chunks a rank holds talk to the
    same peer about the same micro-batch, at different boundaries. Below 2^31 for boundaries
    below 256 and micro-batches below 2^16."""
    return ((boundary * 2**16 + micro_batch) * 2 + int(backward)) * 64 + index


def shape_header(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The per-sample sizes (every dimension but 0) of ``tensors``, concatenated, as int64."""
    sizes = [int(d) for t in tensors for d in t.shape[1:]]
    return torch.tensor(sizes, dtype=torch.int64, device=device)


def header_buffer(spec: BoundarySpec, device: torch.device) -> torch.Tensor:
    """A receive buffer for the shape header of a message of ``spec``'s tensors."""
    n = sum(len(t.sample_shape) for t in spec.tensors)
    return torch.empty(n, dtype=torch.int64, device=device)


def sample_shapes(spec: BoundarySpec, header: torch.Tensor) -> list[tuple[int, ...]]:
    """Inverse of :func:`shape_header`: each tensor's per-sample shape (ranks from ``spec``)."""
    sizes = [int(v) for v in header.tolist()]
    out, at = [], 0
    for t in spec.tensors:
        k = len(t.sample_shape)
        out.append(tuple(sizes[at : at + k]))
        at += k
    return out


def _to(value: Any, device: torch.device) -> Any:
    return unflatten(isinstance(value, (tuple, list)), [t.to(device) for t in flatten(value)])


def infer_boundary_specs(
    plan: Plan,
    rank: int,
    module: nn.Module | Mapping[int, nn.Module] | None,
    probe_input: Any,
    device: torch.device,
) -> list[BoundarySpec]:
    """The spec of every stage boundary (index ``s`` = output of stage ``s``), on every rank.

    Args:
        plan: the plan being run.
        rank: this process's rank (== device id); ranks outside the plan pass ``module=None``.
        module: this rank's stage layers, or ``{stage: layers}`` of each chunk it holds.
        probe_input: one sample of the model inputs (used by stage 0's replica 0).
        device: where the stage lives.

    A collective: every rank of the world must call it. Replica 0 of each stage runs its layers
    on the previous stage's probe output, stage by stage in pipeline order (a rank holding
    several chunks runs each when its input arrives).
    """
    S = plan.num_stages
    chunks: dict[int, nn.Module] = {}
    if isinstance(module, nn.Module):
        chunks = {plan.stage_of_device(rank)[0]: module}
    elif module is not None:
        chunks = dict(module)
    specs: dict[int, BoundarySpec] = {}
    own: Any = None  # the probe output a chunk hands to this rank's next chunk (ZB-V's turn)
    for s, mod in sorted(chunks.items()):
        if plan.stages[s].devices.index(rank) != 0 or s == S - 1:
            continue
        if s == 0:
            x = _to(probe_input, device)
        elif plan.stages[s - 1].devices[0] == rank:
            x = own
        else:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=plan.stages[s - 1].devices[0])
            x = _to(box[0], device)
        was_training = mod.training
        mod.eval()
        with torch.no_grad():
            y = mod(x)
        mod.train(was_training)
        specs[s] = BoundarySpec.of(y)
        if s + 1 < S - 1:  # the last stage computes no boundary, so it needs no probe input
            if plan.stages[s + 1].devices[0] == rank:
                own = y
            else:
                dist.send_object_list(
                    [_to(y, torch.device("cpu"))], dst=plan.stages[s + 1].devices[0]
                )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, specs)
    return [gathered[plan.stages[s].devices[0]][s] for s in range(S - 1)]
