"""Mixed precision: autocast of every stage forward, fp32 master weights, fp16 loss scaling.

``TrainConfig.precision`` is ``fp32`` (no autocast), ``bf16`` or ``fp16``. With a low precision:

- every forward a stage runs - and the recomputed forward under re-computation, which
  ``torch.utils.checkpoint`` replays under the autocast state of the original forward - runs
  inside ``torch.autocast(device_type, dtype)``; parameters, gradients and optimizer state stay
  fp32. Autocast casts each weight once and caches the copy while any autocast context is open;
  :meth:`Precision.weight_cache` keeps one open over the step's compute, so all micro-batches
  (and their backward) share ONE low-precision copy of the weights per step - the *weight cast
  cache* the planner adds (:mod:`dapple.planner.memory`) - dropped before ``OPT`` changes the
  weights;
- the loss is computed in fp32, outside autocast, on the last stage's output cast to fp32;
- stage-boundary tensors travel in the dtype autocast produced (e.g. bf16 activations: half the
  bytes of fp32): the runtime's shape probe (:func:`dapple.runtime.transport.infer_boundary_specs`)
  runs under the same autocast, so the receivers' preallocated buffers have that dtype, and the
  gradients sent back have the dtype of the activations they belong to;
- fp16 scales the loss before backward (:class:`LossScaler`, dynamic loss scaling as in
  Micikevicius et al., "Mixed Precision Training", ICLR 2018, with the defaults of
  ``torch.amp.GradScaler``: initial scale 2**16, halve on overflow, double after 2000 clean
  steps). The overflow decision is the step's world collective
  (:meth:`dapple.runtime.guard.NonFiniteGuard.agree_finite`): a non-finite gradient on any rank skips
  the step on every rank and halves the scale there (:meth:`Precision.overflow`); otherwise the
  ``OPT`` action divides the gradients by the scale before the step's collective
  (:meth:`Precision.unscale_grads`) and counts the clean step after it
  (:meth:`Precision.clean_step`). Every rank of the plan thus
  holds the same scale; checkpoints save it (:meth:`Precision.state_dict`).

bf16 has fp32's exponent range and needs no loss scaling.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dapple.core.precision import TRAINING_PRECISIONS, ComputePrecision, precision_of
from dapple.errors import ValidationError

__all__ = [
    "AUTOCAST_DTYPES",
    "CPU_FP16_ENV",
    "LossScaler",
    "Precision",
    "check_precision",
    "resolve_precision_device",
    "to_fp32",
]

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {
    p.value: getattr(torch, p.dtype_name) for p in ComputePrecision if p.trains and p.autocast
}
"""The autocast compute dtype of each low precision the runtime trains in, by name."""
CPU_FP16_ENV = "DAPPLE_TEST_CPU_FP16"
"""Test hook: with ``1`` here fp16 is accepted on the CPU (torch's CPU autocast computes fp16,
slowly), so the loss scaling can be tested without a GPU."""
_NOTHING = contextlib.nullcontext()
"""What fp32 computes under instead of autocast's contexts (reusable)."""


def resolve_precision_device(device: str | torch.device) -> torch.device:
    """The device type a run on ``device`` (``auto``, ``cpu``, ``cuda[:N]``) computes on."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_precision(precision: str, device: str | torch.device) -> None:
    """Check that ``precision`` can train on ``device`` (before any compute).

    Args:
        precision: ``fp32``, ``bf16`` or ``fp16``.
        device: ``auto``, ``cpu``, ``cuda[:N]`` or a torch device.

    Raises:
        ValidationError: an unknown precision, fp16 on the CPU, or bf16 on a CUDA device
            without bf16 support.
    """
    if precision not in TRAINING_PRECISIONS:
        raise ValidationError(
            f"precision must be one of {', '.join(TRAINING_PRECISIONS)}, got {precision!r}"
        )
    prec = precision_of(precision)
    dev = resolve_precision_device(device)
    cpu_refused = not prec.trains_on_cpu and os.environ.get(CPU_FP16_ENV) != "1"
    if cpu_refused and dev.type == "cpu":
        raise ValidationError(
            f"precision {precision}: {precision} autocast on CPU is not supported for training "
            "(use bf16 on the CPU, or fp32)"
        )
    cuda = dev.type == "cuda" and torch.cuda.is_available()
    if prec is ComputePrecision.BF16 and cuda and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(dev)
        raise ValidationError(
            f"precision bf16: CUDA device {name!r} does not support bf16 (use fp16 or fp32)"
        )


def to_fp32(value: Any) -> Any:
    """``value`` (a tensor or a tuple/list of them) with low-precision floats cast to fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_fp32(v) for v in value)
    return value


@dataclass(slots=True)
class LossScaler:
    """Dynamic loss scaling (the policy of ``torch.amp.GradScaler``).

    ``scale`` multiplies the loss before backward. A step whose gradients are non-finite
    (an fp16 overflow) is skipped and the scale multiplied by ``backoff_factor``; after
    ``growth_interval`` consecutive clean steps it is multiplied by ``growth_factor``.
    Pure Python: the overflow verdict comes from the caller.
    """

    scale: float = 2.0**16
    """The current loss scale S."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    """Clean steps in a row before the scale grows."""
    clean_steps: int = 0
    """Clean steps since the last growth or overflow."""

    def update(self, overflow: bool) -> None:
        """Account for one step: halve on ``overflow``, else count it and grow when due."""
        if overflow:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


class Precision:
    """One rank's precision: the autocast context, the fp16 loss scale and the unscale.

    Args:
        precision: ``fp32``, ``bf16`` or ``fp16`` (checked with :func:`check_precision`).
        device: the rank's device.
        scaler: the loss scaler of ``fp16`` (default: :class:`LossScaler` defaults).

    Raises:
        ValidationError: as :func:`check_precision`.
    """

    def __init__(
        self, precision: str, device: torch.device, scaler: LossScaler | None = None
    ) -> None:
        check_precision(precision, device)
        self.name = precision
        self.device = device
        self.dtype = AUTOCAST_DTYPES.get(precision)
        """The autocast dtype (None: fp32, no autocast)."""
        self.scaler = (scaler or LossScaler()) if precision_of(precision).loss_scaling else None
        """Dynamic loss scaling (fp16 only)."""
        self.overflow_steps: list[int] = []
        """Steps skipped for an fp16 gradient overflow."""

    @property
    def loss_scale(self) -> float:
        """S: what the loss is multiplied by before backward (1 without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast to :attr:`dtype` on the device's type (nothing for fp32)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def weight_cache(self) -> contextlib.AbstractContextManager[Any]:
        """One step's compute (every F and B): autocast's cast copies of the weights live until
        its end, shared by every micro-batch, instead of one copy per micro-batch forward.

        An outer, disabled autocast keeps autocast's nesting level above zero, which is what
        keeps its cache (``torch.autocast.__exit__`` clears it at level 0); leaving it clears
        the cache, so ``OPT`` must come after. Nothing for fp32 (a shared no-op context).
        """
        if self.dtype is None:
            return _NOTHING
        return torch.autocast(self.device.type, enabled=False)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times S, for backward (the loss itself without loss scaling)."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def unscale(self, params: Iterable[nn.Parameter]) -> None:
        """Divide the (finite) gradients by S and count a clean step: :meth:`unscale_grads`
        then :meth:`clean_step`."""
        self.unscale_grads(params)
        self.clean_step()

    def unscale_grads(self, params: Iterable[nn.Parameter]) -> None:
        """``OPT``, before the step's collective: divide the gradients by S (a non-finite one
        stays non-finite). Nothing without loss scaling."""
        if self.scaler is None:
            return
        inv = 1.0 / self.scaler.scale  # S is a power of two: exact
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, inv)

    def clean_step(self) -> None:
        """The step's collective found every gradient finite: count a clean step (the scale
        grows every ``growth_interval`` of them). Nothing without loss scaling."""
        if self.scaler is not None:
            self.scaler.update(overflow=False)

    def overflow(self, step: int) -> bool:
        """A non-finite gradient at ``step`` on some rank: with loss scaling, halve S and
        return True (the step is skipped, the run goes on); without, return False."""
        if self.scaler is None:
            return False
        self.scaler.update(overflow=True)
        self.overflow_steps.append(step)
        log.info("step %d: fp16 gradient overflow, loss scale now %g", step, self.scaler.scale)
        return True

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (the loss scaler's state; empty without one)."""
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a checkpoint without a scaler state keeps the initial
        scale)."""
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])


# ------------------------------------------------------------------ dapple verify's reference
_VERIFY_TOLERANCES = {
    ComputePrecision.FP32.value: (1.3e-6, 1e-5),
    ComputePrecision.BF16.value: (1.6e-2, 1e-3),
}
"""``(rtol, atol)`` of each precision ``dapple verify`` supports, by name (:func:`tolerances_for`)."""


def tolerances_for(precision: str) -> tuple[float, float]:
    """``(rtol, atol)`` that ``dapple verify`` allows at ``precision``.

    fp32: ``torch.testing.assert_close``'s float32 defaults. bf16: a pipeline computes each
    micro-batch's weight gradient in bf16 (rounded to 8 mantissa bits before the fp32
    accumulation) where the one-process reference rounds the full-batch gradient once, and
    matrix products over other batch sizes round differently; verify judges bf16 gradients
    (as a fraction of their layer's scale), losses and gradient norms at ``rtol``, which is
    ``assert_close``'s bf16 ``rtol = 1.6e-2``. Measured before verify went step by step (G = 8,
    b = 4, M = 2, 3 steps, CPU, plans 1:1 and 3:1): a small MLP's parameters ended 4.9e-5 (SGD)
    apart, the zoo transformer's 3.0e-5 and its losses 5.5e-4; fp32 on the same runs: 6e-8.

    Raises:
        ValidationError: an unknown precision or one verify does not support (fp16).
    """
    tolerances = _VERIFY_TOLERANCES.get(precision)
    if tolerances is not None:
        return tolerances
    raise ValidationError(
        f"verify supports precision fp32 or bf16, got {precision!r} (the one-process "
        "reference runs on the CPU, where fp16 autocast does not train)"
    )


def check_verify_precision(precision: str, device: str) -> None:
    """Check ``precision`` for ``dapple verify`` on ``device`` (the reference runs on the CPU).

    Raises:
        ValidationError: as :func:`check_precision` and :func:`tolerances_for`.
    """
    check_precision(precision, device)
    tolerances_for(precision)


@contextlib.contextmanager
def autocast_reference(precision: str) -> Iterator[Any]:
    """The one-process reference's forward at ``precision`` on the CPU; yields the cast the
    output needs before the fp32 loss (:func:`to_fp32`, or the identity for fp32)."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        yield lambda v: v
        return
    with torch.autocast("cpu", dtype=dtype):
        yield to_fp32
