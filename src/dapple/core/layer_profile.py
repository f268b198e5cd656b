"""One layer of a model profile (paper section 3.3): its times and its sizes.

Pure data model, no torch. Times are affine in the batch size ``b`` of one forward or
backward call, ``t(b) = fixed_ms + per_sample_ms * b`` (:class:`AffineTime`), fitted from
measurements at several batch sizes (:func:`fit_affine`). Sizes are bytes; activation sizes
are per sample. A :class:`LayerProfile` is one link of the chain the planner cuts; the whole
chain is a :class:`~dapple.core.profile.ModelProfile`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dapple.core._json import as_float, as_list, as_nonneg, get_field, require
from dapple.core.moe_profile import MoEProfile

__all__ = ["AffineTime", "LayerProfile", "fit_affine"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AffineTime:
    """Time of one call on ``b`` samples: ``fixed_ms + per_sample_ms * b`` (milliseconds)."""

    fixed_ms: float
    """Per-call overhead independent of the batch size (kernel launches, Python)."""
    per_sample_ms: float
    """Marginal time of one more sample."""

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_sample_ms"):
            v = getattr(self, name)
            require(
                isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                f"AffineTime.{name} must be a finite number >= 0, got {v!r}",
            )

    def at(self, b: float) -> float:
        """Time in ms of one call on ``b`` samples; 0 for ``b == 0`` (no call is made)."""
        return 0.0 if b <= 0 else self.fixed_ms + self.per_sample_ms * b

    def to_dict(self) -> dict[str, float]:
        return {"fixed_ms": self.fixed_ms, "per_sample_ms": self.per_sample_ms}

    @staticmethod
    def from_dict(d: Any, what: str = "AffineTime") -> AffineTime:
        require(
            isinstance(d, dict), f"{what} must be an object with fixed_ms/per_sample_ms, got {d!r}"
        )
        return AffineTime(
            fixed_ms=as_float(get_field(d, "fixed_ms", what), f"{what}.fixed_ms"),
            per_sample_ms=as_float(get_field(d, "per_sample_ms", what), f"{what}.per_sample_ms"),
        )


def fit_affine(batch_sizes: Sequence[float], times_ms: Sequence[float]) -> AffineTime:
    """Least-squares fit of ``t(b) = fixed + per_sample * b``, clamped to non-negative terms.

    With a single batch size the whole time is attributed to the per-sample term.
    """
    require(
        len(batch_sizes) == len(times_ms) and len(batch_sizes) > 0,
        f"fit_affine needs equal, non-empty lists, got {len(batch_sizes)} and {len(times_ms)}",
    )
    n = len(batch_sizes)
    if n == 1 or len(set(batch_sizes)) == 1:
        mean_b = sum(batch_sizes) / n
        return AffineTime(fixed_ms=0.0, per_sample_ms=max(0.0, sum(times_ms) / n / mean_b))
    mb = sum(batch_sizes) / n
    mt = sum(times_ms) / n
    sxx = sum((b - mb) ** 2 for b in batch_sizes)
    sxy = sum((b - mb) * (t - mt) for b, t in zip(batch_sizes, times_ms, strict=True))
    slope = sxy / sxx
    icpt = mt - slope * mb
    if slope < 0:  # noise dominated: treat as constant cost
        return AffineTime(fixed_ms=max(0.0, mt), per_sample_ms=0.0)
    if icpt < 0:  # refit through the origin
        slope = sum(b * t for b, t in zip(batch_sizes, times_ms, strict=True)) / sum(
            b * b for b in batch_sizes
        )
        return AffineTime(fixed_ms=0.0, per_sample_ms=max(0.0, slope))
    return AffineTime(fixed_ms=icpt, per_sample_ms=slope)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerProfile:
    """One layer of the chain the planner may cut between."""

    name: str
    """Human-readable layer name (module path or PipeDream node)."""
    forward: AffineTime
    """Forward time of one call as a function of its batch size."""
    backward: AffineTime
    """Backward time of one call (gradients of inputs and parameters)."""
    output_bytes_per_sample: float
    """Bytes of this layer's output per sample: what crosses a cut placed after it."""
    parameter_bytes: int
    """Bytes of this layer's parameters (its own; tied copies are counted on each holder)."""
    kept_activation_bytes_per_sample: float
    """Activation bytes held from forward until backward, per sample (without re-computation)."""
    backward_input: AffineTime | None = None
    """Time of the input-gradient half of the backward (zero-bubble ``I``) when measured;
    None: :meth:`backward_split`'s assumed split."""
    backward_weight: AffineTime | None = None
    """Time of the weight-gradient half (``W``) when measured beside ``backward_input``: the
    two halves as the runtime runs them, which together may take longer than ``backward``
    (the split's own graph walks); None: ``W`` is the rest of ``backward``."""
    tied_parameter_bytes: int = 0
    """Bytes of ``parameter_bytes`` that are this layer's copies of parameters tied to other
    layers (``Workload.tied_parameters``, e.g. GPT-2's embedding and LM head): their gradients
    are summed whole over the copies, outside a replicated stage's flat buckets."""
    tied_layers: tuple[int, ...] = ()
    """The other layers holding copies of this layer's tied parameters."""
    cast_parameter_bytes: int | None = None
    """Bytes of ``parameter_bytes`` that autocast casts to 16 bits (weights of matrix products,
    their biases); None: all of them. An embedding table (a lookup, not an autocast op) and
    norm weights are not cast (:mod:`dapple.cost.peak_memory`)."""
    tensor_parallel: bool = False
    """The layer shards over a tensor-parallel group (a transformer block's matrix products,
    Megatron-LM): its compute, parameters (less tied copies) and most kept activations divide
    by the width t, at two all-reduces of its output per forward and two per backward
    (:mod:`dapple.cost.tensor`). False (the safe default): it runs whole on every rank."""
    moe: MoEProfile | None = None
    """The layer's mixture of experts (experts, top-k, routed tokens, all-to-all bytes); None:
    a dense layer."""
    parameter_sizes: tuple[int, ...] | None = None
    """Bytes of each trainable parameter outside ``tied_parameter_bytes``, in registration
    order (``module.parameters()``): the tensors a replicated stage's gradient buckets take one
    by one (:func:`dapple.core.buckets.bucket_runs`). None (profiles written without it, and
    layers whose parameters are not known one by one): the layer counts as one tensor of its
    untied bytes (:meth:`bucketed_sizes`)."""

    def bucketed_sizes(self) -> tuple[int, ...]:
        """The bytes of the tensors this layer puts in gradient buckets, in registration
        order: :attr:`parameter_sizes`, or when unknown one tensor of ``parameter_bytes -
        tied_parameter_bytes`` (none when that is 0)."""
        if self.parameter_sizes is not None:
            return self.parameter_sizes
        untied = self.parameter_bytes - self.tied_parameter_bytes
        return (untied,) if untied > 0 else ()

    def backward_split(self, b: float) -> tuple[float, float]:
        """``(I, W)``: the input- and weight-gradient halves of the backward on ``b`` samples, ms.

        Measured when ``backward_input`` is set: W is ``backward_weight`` when that is measured
        too, else the rest of the backward (backward - I, at least 0). Otherwise an
        assumption, not a measurement: a layer without parameters has no weight gradient
        (all of it is I); a layer with parameters splits its backward evenly, because for the
        matrix products that dominate it, ``dX = dY·Wᵀ`` and ``dW = Xᵀ·dY`` take the same
        FLOPs (the ``T_B = T_W`` of Qi et al., ICLR 2024, section 2).
        """
        total = self.backward.at(b)
        if self.backward_input is not None and self.backward_weight is not None:
            return self.backward_input.at(b), self.backward_weight.at(b)
        if self.backward_input is not None:
            i = min(self.backward_input.at(b), total)
            return i, total - i
        if self.parameter_bytes == 0:
            return total, 0.0
        return total / 2, total / 2

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and self.name != "",
            f"LayerProfile.name must be a non-empty string, got {self.name!r}",
        )
        as_nonneg(self.output_bytes_per_sample, f"layer {self.name!r}: output_bytes_per_sample")
        as_nonneg(
            self.kept_activation_bytes_per_sample,
            f"layer {self.name!r}: kept_activation_bytes_per_sample",
        )
        require(
            isinstance(self.parameter_bytes, int)
            and not isinstance(self.parameter_bytes, bool)
            and self.parameter_bytes >= 0,
            f"layer {self.name!r}: parameter_bytes must be an integer >= 0, got {self.parameter_bytes!r}",
        )
        require(
            isinstance(self.tied_parameter_bytes, int)
            and not isinstance(self.tied_parameter_bytes, bool)
            and 0 <= self.tied_parameter_bytes <= self.parameter_bytes,
            f"layer {self.name!r}: tied_parameter_bytes must be an integer in "
            f"[0, parameter_bytes = {self.parameter_bytes}], got {self.tied_parameter_bytes!r}",
        )
        require(
            isinstance(self.tied_layers, tuple)
            and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.tied_layers
            )
            and (self.tied_parameter_bytes > 0) == (len(self.tied_layers) > 0),
            f"layer {self.name!r}: tied_layers must be layer indices >= 0, given exactly when "
            f"tied_parameter_bytes > 0; got {self.tied_layers!r} with {self.tied_parameter_bytes}",
        )
        require(
            self.cast_parameter_bytes is None
            or (
                isinstance(self.cast_parameter_bytes, int)
                and 0 <= self.cast_parameter_bytes <= self.parameter_bytes
            ),
            f"layer {self.name!r}: cast_parameter_bytes must be None or an integer in "
            f"[0, parameter_bytes = {self.parameter_bytes}], got {self.cast_parameter_bytes!r}",
        )
        require(
            isinstance(self.tensor_parallel, bool),
            f"layer {self.name!r}: tensor_parallel must be a bool, got {self.tensor_parallel!r}",
        )
        require(
            self.moe is None
            or (
                isinstance(self.moe, MoEProfile)
                and self.moe.expert_parameter_bytes <= self.parameter_bytes
            ),
            f"layer {self.name!r}: moe must be None or a MoEProfile whose expert parameters fit "
            f"in parameter_bytes = {self.parameter_bytes}, got {self.moe!r}"[:300],
        )
        self._check_sizes()

    def _check_sizes(self) -> None:
        sizes = self.parameter_sizes
        untied = self.parameter_bytes - self.tied_parameter_bytes
        require(
            sizes is None
            or (
                isinstance(sizes, tuple)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sizes)
                and sum(sizes) <= untied
            ),
            f"layer {self.name!r}: parameter_sizes must be None or integers >= 0 adding up to "
            f"at most the untied parameter bytes {untied}, got {sizes!r}"[:300],
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "forward": self.forward.to_dict(),
            "backward": self.backward.to_dict(),
            "output_bytes_per_sample": self.output_bytes_per_sample,
            "parameter_bytes": self.parameter_bytes,
            "kept_activation_bytes_per_sample": self.kept_activation_bytes_per_sample,
        }
        if self.backward_input is not None:
            d["backward_input"] = self.backward_input.to_dict()
        if self.backward_weight is not None:
            d["backward_weight"] = self.backward_weight.to_dict()
        if self.tied_parameter_bytes:
            d["tied_parameter_bytes"] = self.tied_parameter_bytes
            d["tied_layers"] = list(self.tied_layers)
        if self.tensor_parallel:
            d["tensor_parallel"] = True
        if self.cast_parameter_bytes is not None:
            d["cast_parameter_bytes"] = self.cast_parameter_bytes
        if self.moe is not None:
            d["moe"] = self.moe.to_dict()
        if self.parameter_sizes is not None:
            d["parameter_sizes"] = list(self.parameter_sizes)
        return d

    @staticmethod
    def from_dict(d: Any, index: int = 0) -> LayerProfile:
        what = f"layer {index}"
        require(isinstance(d, dict), f"{what} must be an object, got {d!r}")
        pb = get_field(d, "parameter_bytes", what)
        require(
            isinstance(pb, (int, float)) and float(pb).is_integer(),
            f"{what}: parameter_bytes must be an integer, got {pb!r}",
        )
        return LayerProfile(
            name=str(get_field(d, "name", what)),
            forward=AffineTime.from_dict(get_field(d, "forward", what), f"{what}.forward"),
            backward=AffineTime.from_dict(get_field(d, "backward", what), f"{what}.backward"),
            output_bytes_per_sample=as_nonneg(
                get_field(d, "output_bytes_per_sample", what), f"{what}: output_bytes_per_sample"
            ),
            parameter_bytes=int(pb),
            kept_activation_bytes_per_sample=as_nonneg(
                get_field(d, "kept_activation_bytes_per_sample", what),
                f"{what}: kept_activation_bytes_per_sample",
            ),
            backward_input=None
            if d.get("backward_input") is None
            else AffineTime.from_dict(d["backward_input"], f"{what}.backward_input"),
            backward_weight=None
            if d.get("backward_weight") is None
            else AffineTime.from_dict(d["backward_weight"], f"{what}.backward_weight"),
            tied_parameter_bytes=d.get("tied_parameter_bytes", 0),
            tied_layers=tuple(as_list(d.get("tied_layers", []), f"{what}: tied_layers")),
            tensor_parallel=d.get("tensor_parallel", False),
            cast_parameter_bytes=d.get("cast_parameter_bytes"),
            moe=None if d.get("moe") is None else MoEProfile.from_dict(d["moe"], f"{what}.moe"),
            parameter_sizes=None
            if d.get("parameter_sizes") is None
            else tuple(as_list(d["parameter_sizes"], f"{what}: parameter_sizes")),
        )
