"""Input shapes that change from step to step: dynamic dimensions, found or declared, and checks.

A *dynamic dimension* is a non-batch dimension of a model input whose size may differ between
steps (a sequence length, an image side). A workload declares them in
:attr:`dapple.models.workload.Workload.dynamic_dims` (``{input position: {dim: DynamicDim}}``,
with the range its layers accept, e.g. ``seq <= `` the position table); the rest are found by
drawing ``make_batch`` at a few seeds and marking the dimensions that differ
(:func:`find_dynamic_dims`). The runtime sends boundary shapes with every message when a model
has any (:mod:`dapple.runtime.transport`), and :func:`check_batch` stops a step whose batch the
layers cannot take - a static dimension that changed, a size outside the range, another rank or
dtype - with one error naming the input, the dimension and the allowed range, before the step
computes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dapple.errors import ValidationError

__all__ = [
    "FIND_DRAWS",
    "BatchSource",
    "DimsArg",
    "DimsMap",
    "DynamicDim",
    "InputShape",
    "check_batch",
    "check_dims_exist",
    "check_steps",
    "find_dynamic_dims",
    "input_shapes",
    "merge_dims",
    "resolve_dims",
    "run_dims",
]

FIND_DRAWS = 3
"""Batches drawn (seeds ``seed .. seed + FIND_DRAWS - 1``) to find the dimensions that vary."""


@dataclass(frozen=True, slots=True)
class DynamicDim:
    """One dynamic input dimension: its name and the sizes the layers accept (inclusive)."""

    name: str
    min: int = 1
    max: int | None = None
    """None: no known upper bound."""

    def __post_init__(self) -> None:
        if self.min < 1 or (self.max is not None and self.max < self.min):
            raise ValidationError(
                f"dynamic dimension {self.name!r}: need 1 <= min <= max, got min={self.min} "
                f"max={self.max}"
            )

    def range_text(self) -> str:
        return f"[{self.min}, {self.max if self.max is not None else 'inf'}]"

    def accepts(self, size: int) -> bool:
        return size >= self.min and (self.max is None or size <= self.max)


DimsMap = Mapping[int, Mapping[int, DynamicDim]]
"""``{input position: {dimension: DynamicDim}}`` (dimension 0, the batch, is never listed)."""


@dataclass(frozen=True, slots=True)
class InputShape:
    """What one input tensor of a step looks like: dtype and full shape (batch first)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def _flat(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def input_shapes(inputs: Any) -> tuple[InputShape, ...]:
    """The dtype and shape of every input tensor of a batch."""
    return tuple(InputShape(t.dtype, tuple(int(d) for d in t.shape)) for t in _flat(inputs))


def find_dynamic_dims(
    make_batch: Callable[[int, int], tuple[Any, torch.Tensor]],
    batch_size: int,
    seed: int,
    draws: int = FIND_DRAWS,
) -> dict[int, dict[int, DynamicDim]]:
    """The non-batch input dimensions whose size differs between ``draws`` batches.

    A found dimension is named ``in{position}_d{dim}`` after the first dimension with the same
    sizes in every draw (an input's ids and its attention mask share one sequence length) and
    has no known upper bound.
    """
    shapes = [input_shapes(make_batch(batch_size, seed + k)[0]) for k in range(draws)]
    found: dict[int, dict[int, DynamicDim]] = {}
    by_sizes: dict[tuple[int, ...], DynamicDim] = {}
    for i, first in enumerate(shapes[0]):
        for d in range(1, len(first.shape)):
            sizes = tuple(s[i].shape[d] for s in shapes if i < len(s) and d < len(s[i].shape))
            if len(set(sizes)) > 1:
                dim = by_sizes.setdefault(sizes, DynamicDim(f"in{i}_d{d}"))
                found.setdefault(i, {})[d] = dim
    return found


DimsArg = Mapping[int | str, Mapping[int, str | DynamicDim | tuple[str, int, int | None] | None]]
"""A user's declaration: inputs by position or forward-argument name, each dimension's name
(``"seq"``), :class:`DynamicDim`, ``(name, min, max)``, or None: static (not traced dynamic
even when its size differs between ``make_batch`` draws)."""


def resolve_dims(
    declared: DimsArg | None, input_names: Sequence[str]
) -> dict[int, dict[int, DynamicDim | None]]:
    """A declaration (``{"input_ids": {1: "seq"}}`` or ``{0: {1: ("seq", 1, 512)}}``) by input
    position; dimensions with one name are one :class:`DynamicDim`.

    Raises:
        ValidationError: an unknown input name or position, dimension 0 (the batch, always
            dynamic), or a bad range.
    """
    out: dict[int, dict[int, DynamicDim | None]] = {}
    named: dict[str, DynamicDim] = {}
    for key, ds in (declared or {}).items():
        if isinstance(key, str) and not key.isdigit():
            if key not in input_names:
                raise ValidationError(
                    f"dynamic_dims names input {key!r}; the inputs are {list(input_names)}"
                )
            i = list(input_names).index(key)
        else:
            i = int(key)
            if not 0 <= i < len(input_names):
                raise ValidationError(
                    f"dynamic_dims names input {i}; the model takes {len(input_names)} inputs"
                )
        for d, v in ds.items():
            if int(d) < 1:
                raise ValidationError(
                    f"dynamic_dims: input {key!r} dimension {d}: dimension 0 is the batch, "
                    "dynamic already; name dimensions >= 1"
                )
            if v is None:
                out.setdefault(i, {})[int(d)] = None
                continue
            if isinstance(v, DynamicDim):
                dim = v
            elif isinstance(v, str):
                dim = named.get(v) or DynamicDim(v)
            else:
                name, lo, hi = v
                dim = DynamicDim(str(name), int(lo), None if hi is None else int(hi))
            named.setdefault(dim.name, dim)
            out.setdefault(i, {})[int(d)] = named[dim.name]
    return out


def merge_dims(
    declared: Mapping[int, Mapping[int, DynamicDim | None]], found: DimsMap
) -> dict[int, dict[int, DynamicDim]]:
    """``found`` with ``declared`` on top (a declared dimension keeps its name and range; one
    declared ``None`` is static even if it was found)."""
    out: dict[int, dict[int, DynamicDim]] = {i: dict(ds) for i, ds in found.items()}
    for i, ds in declared.items():
        for d, dim in ds.items():
            if dim is None:
                out.get(i, {}).pop(d, None)
            else:
                out.setdefault(i, {})[d] = dim
    return {i: ds for i, ds in out.items() if ds}


def check_batch(
    reference: tuple[InputShape, ...], dims: DimsMap, inputs: Any, *, where: str
) -> None:
    """Raise unless ``inputs`` has the reference's number of inputs, ranks and dtypes, its
    static dimensions and dynamic sizes inside their ranges (the batch dimension is free).

    Args:
        reference: the shapes the run was set up with (its first batch).
        dims: the run's dynamic dimensions.
        inputs: this batch's inputs.
        where: what the batch is (``"step 3"``), for the message.

    Raises:
        ValidationError: naming the input, the dimension and the allowed sizes.
    """
    flat = _flat(inputs)
    if not dims and len(flat) == len(reference):  # static shapes: equal ones pass at once
        for t, ref in zip(flat, reference, strict=True):
            if t.dtype != ref.dtype or t.shape[1:] != ref.shape[1:]:
                break
        else:
            return
    got = input_shapes(flat)
    if len(got) != len(reference):
        raise ValidationError(
            f"{where}: the batch has {len(got)} inputs, the model was set up with {len(reference)}"
        )
    for i, (ref, now) in enumerate(zip(reference, got, strict=True)):
        if now.dtype != ref.dtype:
            raise ValidationError(
                f"{where}: input {i} has dtype {now.dtype}, the model takes {ref.dtype}"
            )
        if len(now.shape) != len(ref.shape):
            raise ValidationError(
                f"{where}: input {i} has {len(now.shape)} dimensions {list(now.shape)}, the "
                f"model takes {len(ref.shape)} ({list(ref.shape)})"
            )
        declared = dims.get(i, {})
        for d in range(1, len(ref.shape)):
            size = now.shape[d]
            dyn = declared.get(d)
            if dyn is None and size != ref.shape[d]:
                raise ValidationError(
                    f"{where}: input {i} dimension {d} is {size}, but it is static (always "
                    f"{ref.shape[d]}); declare it dynamic (dynamic_dims={{{i}: {{{d}: ...}}}}, "
                    f"--dynamic-dims {i}:{d}=NAME) if it may change"
                )
            if dyn is not None and not dyn.accepts(size):
                raise ValidationError(
                    f"{where}: input {i} dimension {d} ({dyn.name}) is {size}, outside the "
                    f"allowed range {dyn.range_text()}"
                )


class BatchSource(Protocol):
    """What the run-level checks read of a workload (:class:`~dapple.models.workload.Workload`
    is one; this module does not import it, which imports :class:`DynamicDim` from here)."""

    @property
    def make_batch(self) -> Callable[[int, int], tuple[Any, torch.Tensor]]: ...

    @property
    def dynamic_dims(self) -> Mapping[int, Mapping[int, DynamicDim | None]]: ...


def run_dims(workload: BatchSource, batch_size: int, seed: int) -> dict[int, dict[int, DynamicDim]]:
    """A run's dynamic dimensions: the workload's declared ones and those that differ between
    ``make_batch`` draws of the run's batch size at seeds ``seed ..`` (a workload's batches
    need only work at the sizes the run asks for)."""
    found = find_dynamic_dims(workload.make_batch, batch_size, seed)
    return merge_dims(workload.dynamic_dims, found)


def check_steps(workload: BatchSource, batch_size: int, seed: int, steps: int) -> None:
    """:func:`check_batch` of the batches of steps ``1 .. steps - 1`` against step 0's, as the
    runtime checks them, but all before any compute (used where the batches are drawn anyway).

    Raises:
        ValidationError: the first step whose batch the model cannot take.
    """
    dims = run_dims(workload, batch_size, seed)
    reference = input_shapes(workload.make_batch(batch_size, seed)[0])
    for step in range(1, steps):
        inputs = workload.make_batch(batch_size, seed + step)[0]
        check_batch(reference, dims, inputs, where=f"step {step}")


def check_dims_exist(dims: Mapping[int, Mapping[int, Any]], inputs: Sequence[Any]) -> None:
    """Each declared dimension exists in its input (one sample batch's ``inputs``, by position).

    Raises:
        ValidationError: naming the input, its shape and the dimension it lacks.
    """
    for i, ds in dims.items():
        shape = list(getattr(inputs[i], "shape", ()))
        bad = sorted(d for d in ds if d >= len(shape))
        if bad:
            raise ValidationError(
                f"dynamic_dims: input {i} has {len(shape)} dimensions (shape {shape}), no "
                f"dimension {bad[0]}"
            )
