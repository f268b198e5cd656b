"""Capture a model with ``torch.export`` for :mod:`dapple.models.split_graph` to cut.

Design choices:
    - The model is traced without its weights, as if it ran on the CPU: every parameter,
      buffer and input is a ``FakeTensor`` on :data:`TRACE_DEVICE` (shapes, dtypes and a device,
      no storage; :func:`fake_copy`). A model built on ``meta`` costs no memory, but a trace
      *on* ``meta`` records what its forward does there: code that chooses its ops by device
      (``x.float() if x.device.type == "cpu" else x.int()`` before ``torch.histc``, as Hugging
      Face's grouped-matmul experts do) would take the non-CPU branch, and the graph would then
      fail on the CPU the pieces run on. :func:`fake_to_meta` turns the traced module's tensors
      back into ``meta`` ones (weights are loaded per seed later); constants the forward made
      are real tensors and keep their values.
    - Dimension 0 of every input is dynamic, and so is each declared or found dynamic
      dimension, with its range (:func:`export_model`); :func:`traced_dims` reads back the
      ranges the trace is valid for. A failed trace is one :class:`ValidationError` naming the
      dimension it could not take dynamic.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dapple.errors import ValidationError
from dapple.models.shapes import DimsMap, DynamicDim

__all__ = [
    "TRACE_DEVICE",
    "export_model",
    "fake_copy",
    "fake_to_meta",
    "output_is_tuple",
    "traced_dims",
]

TRACE_DEVICE = torch.device("cpu")
"""The device a weightless model is traced for: its device-dependent branches follow it. Pieces
moved to another device run the ops of that branch there (devices baked into ops follow the
pieces' inputs, :func:`dapple.models.split_graph._follow_input_device`)."""


def _fake(mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> FakeTensor:
    """A fake tensor on ``device`` with the shape, strides and dtype of ``t``."""
    meta = t.detach() if t.is_meta else t.detach().to("meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)


def fake_copy(
    model: nn.Module, inputs: tuple[Any, ...], device: torch.device = TRACE_DEVICE
) -> tuple[nn.Module, tuple[Any, ...]]:
    """``model`` (changed in place) and ``inputs`` with every tensor a fake one on ``device``.

    Tensors shared between modules (tied weights) stay shared. Tensors held as plain attributes
    (not parameters or buffers) are left as they are.

    Args:
        model: A model whose parameters and buffers may be on ``meta``; pass a copy.
        inputs: The example inputs (tensors on any device, or other values).
        device: The device the trace sees.
    """
    mode = FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            ft = _fake(mode, t, device)
            memo[id(t)] = nn.Parameter(ft, t.requires_grad) if isinstance(t, nn.Parameter) else ft
        return memo[id(t)]

    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                mod._parameters[name] = fake(p)  # type: ignore[assignment]
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = fake(b)
    fake_inputs = tuple(
        _fake(mode, x, device) if isinstance(x, torch.Tensor) else x for x in inputs
    )
    return model, fake_inputs


def _unfake(t: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor with the shape, strides and dtype of fake ``t`` (a parameter stays
    one)."""
    out = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")
    return nn.Parameter(out, t.requires_grad) if isinstance(t, nn.Parameter) else out


def fake_to_meta(module: nn.Module) -> None:
    """Replace, in place, every fake parameter, buffer and tensor attribute of ``module`` and
    its submodules by a ``meta`` tensor; shared tensors stay shared, real ones (constants the
    forward made, lifted by ``torch.export`` with their values) are kept."""
    memo: dict[int, torch.Tensor] = {}

    def swap(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, FakeTensor):
            return t
        if id(t) not in memo:
            memo[id(t)] = _unfake(t)
        return memo[id(t)]

    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                mod._parameters[name] = swap(p)  # type: ignore[assignment]
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = swap(b)
        for name, value in list(vars(mod).items()):
            if isinstance(value, FakeTensor):
                setattr(mod, name, swap(value))


_TRACE_LOGGERS = ("torch.fx.experimental.symbolic_shapes",)
"""Loggers that warn about a failed trace: the error raised says what failed."""


@contextlib.contextmanager
def _quiet_trace() -> Iterator[None]:
    """While ``torch.export`` runs: only errors from :data:`_TRACE_LOGGERS`, and what it prints
    to stderr (the partial graph of a failed trace) dropped, so a failure is one error."""
    loggers = [logging.getLogger(n) for n in _TRACE_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_model(
    model: nn.Module, inputs: tuple[Any, ...], dims: DimsMap | None = None
) -> torch.export.ExportedProgram:
    """Export with dimension 0 of every tensor input dynamic, and the ``dims`` of each input
    (one ``torch.export.Dim`` per :class:`DynamicDim` name, with its range)."""
    dyn = torch.export.Dim.DYNAMIC
    dims = dims or {}
    named: dict[str, Any] = {}
    for ds in dims.values():
        for dd in ds.values():
            if dd.name not in named:
                named[dd.name] = torch.export.Dim(dd.name, min=dd.min, max=dd.max)
    shapes = tuple(
        {0: dyn, **{d: named[dd.name] for d, dd in dims.get(i, {}).items()}}
        if isinstance(t, torch.Tensor) and t.dim() > 0
        else None
        for i, t in enumerate(inputs)
    )
    try:
        with _quiet_trace():
            ep = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
    except Exception as e:  # torch raises many types; report them as one user error
        text = str(e)
        culprits = [
            f"input {i} dimension {d} ({dd.name})"
            for i, ds in dims.items()
            for d, dd in ds.items()
            if f"{dd.name} = " in text or f"{dd.name} " in text.split("\n")[0]
        ]
        if "Constraints violated" in text and culprits:
            raise ValidationError(
                f"{type(model).__name__}.forward cannot be traced with {', '.join(culprits)} "
                "dynamic: it fixes or branches on that size; declare the dimension static (or "
                "give the range the model accepts)"
            ) from e
        if "Constraints violated" in text:
            raise ValidationError(
                f"{type(model).__name__}.forward fixes the batch size (dimension 0 of its "
                "inputs); the layer chain needs any batch size"
            ) from e
        raise ValidationError(
            f"cannot trace {type(model).__name__} with torch.export: {type(e).__name__}: "
            f"{text.splitlines()[0] if text else ''}"
        ) from e
    return ep


def traced_dims(
    program: torch.export.ExportedProgram, dims: DimsMap
) -> dict[int, dict[int, DynamicDim]]:
    """``dims`` with the ranges ``torch.export`` found the traced graph valid for."""
    placeholders = [
        n for n in program.graph.nodes if n.op == "placeholder" and n.name in _user_inputs(program)
    ]
    out: dict[int, dict[int, DynamicDim]] = {}
    for i, ds in dims.items():
        val = placeholders[i].meta.get("val") if i < len(placeholders) else None
        for d, dd in ds.items():
            size = val.shape[d] if isinstance(val, torch.Tensor) and d < val.dim() else None
            vr = (
                program.range_constraints.get(size.node.expr)
                if isinstance(size, torch.SymInt)
                else None
            )
            lo, hi = dd.min, dd.max
            if vr is not None:
                lower, upper = _range_end(vr.lower), _range_end(vr.upper)
                if lower is not None:
                    lo = max(lo, lower)
                if upper is not None:
                    hi = upper if hi is None else min(hi, upper)
            out.setdefault(i, {})[d] = DynamicDim(dd.name, lo, hi)
    return out


def _range_end(bound: Any) -> int | None:
    """One end of a ``torch.export`` value range as an int; None when it is unbounded.

    Unbounded ends are sympy's ``oo`` or torch's ``int_oo``, which sympy calls finite (an
    integer larger than any other), so the test is for a concrete integer instead.
    """
    return int(bound) if getattr(bound, "is_Integer", False) else None


def _user_inputs(program: torch.export.ExportedProgram) -> set[str]:
    return set(program.graph_signature.user_inputs)


def output_is_tuple(model: nn.Module, program: torch.export.ExportedProgram) -> bool:
    """Whether the traced model returns a tuple of tensors (else one tensor).

    Raises:
        ValidationError: It returns anything else.
    """
    spec = program.call_spec.out_spec
    if spec is not None and spec.is_leaf():
        return False
    kind = getattr(spec, "type", None)
    if kind is tuple and all(spec.child(i).is_leaf() for i in range(spec.num_children)):
        return True
    raise ValidationError(
        f"{type(model).__name__} must return a tensor or a tuple of tensors, "
        f"got {getattr(kind, '__name__', kind)}"
    )
