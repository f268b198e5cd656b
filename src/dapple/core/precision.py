"""The compute precisions: one registry of what each one means to the planner and the runtime.

Pure data, no torch: a precision carries torch's *name* of its dtype (:attr:`dtype_name`); the
torch side (:mod:`dapple.runtime.precision`, :mod:`dapple.profiler.layer_measure`) maps it to a
``torch.dtype`` and an autocast context. Profiles, plans and configurations keep the precision as
its name (``"fp32"``, ``"bf16"``, ...); :func:`precision_of` turns a name into its entry.

- ``fp32``: no autocast; tensors of 4 bytes.
- ``bf16``, ``fp16``: every forward runs under autocast over fp32 master weights (each weight
  cast once, a 2-byte copy); tensors of 2 bytes. ``fp16`` scales the loss (dynamic loss
  scaling) and does not train on the CPU.
- ``fp8``: analytic profiles only (:mod:`dapple.profiler.analytic`): GEMMs over weights compute
  in fp8, everything else - tensors kept and sent, attention - in bf16.
"""

from __future__ import annotations

import enum

from dapple.errors import ValidationError

__all__ = [
    "ANALYTIC_PRECISIONS",
    "TRAINING_PRECISIONS",
    "ComputePrecision",
    "precision_of",
]


class ComputePrecision(enum.Enum):
    """A compute precision; its value is its name."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    @property
    def autocast(self) -> bool:
        """Whether forwards run under autocast over fp32 master weights (all but fp32)."""
        return self is not ComputePrecision.FP32

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled before backward (dynamic loss scaling: fp16)."""
        return self is ComputePrecision.FP16

    @property
    def trains(self) -> bool:
        """Whether the runtime trains in it and a profile can be measured in it (not fp8)."""
        return self is not ComputePrecision.FP8

    @property
    def trains_on_cpu(self) -> bool:
        """Whether torch's CPU autocast trains in it (not fp16)."""
        return self.trains and self is not ComputePrecision.FP16

    @property
    def tensor_precision(self) -> ComputePrecision:
        """The precision tensors are kept and sent in, and GEMMs without weights compute in
        (fp8: bf16; the others: itself)."""
        return ComputePrecision.BF16 if self is ComputePrecision.FP8 else self

    @property
    def element_bytes(self) -> int:
        """Bytes of one element of the tensors a forward keeps and sends (fp8: bf16's 2)."""
        return 4 if self is ComputePrecision.FP32 else 2

    @property
    def weight_cast_factor(self) -> float:
        """Autocast's copy of a weight, as a fraction of its fp32 bytes (fp32: no copy, 0)."""
        return self.element_bytes / 4 if self.autocast else 0.0

    @property
    def dtype_name(self) -> str:
        """torch's name of the compute dtype (``getattr(torch, dtype_name)``)."""
        return _DTYPE_NAMES[self]


_DTYPE_NAMES = {
    ComputePrecision.FP32: "float32",
    ComputePrecision.BF16: "bfloat16",
    ComputePrecision.FP16: "float16",
    ComputePrecision.FP8: "float8_e4m3fn",
}

ANALYTIC_PRECISIONS = tuple(p.value for p in ComputePrecision)
"""Names of the precisions an analytic profile takes (all of them)."""
TRAINING_PRECISIONS = tuple(p.value for p in ComputePrecision if p.trains)
"""Names of the precisions the runtime trains in and a profile is measured in."""


def precision_of(name: str) -> ComputePrecision:
    """The registry entry of the precision named ``name``.

    Raises:
        ValidationError: no precision has that name.
    """
    try:
        return ComputePrecision(name)
    except ValueError:
        raise ValidationError(
            f"precision must be one of {', '.join(ANALYTIC_PRECISIONS)}, got {name!r}"
        ) from None
