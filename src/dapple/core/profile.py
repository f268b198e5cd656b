"""Per-layer model profile (paper section 3.3): times, activation and parameter sizes.

Pure data model, no torch. Times are affine in the batch size ``b`` of one forward or
backward call, ``t(b) = fixed_ms + per_sample_ms * b``, fitted from measurements at several
batch sizes. Sizes are bytes; activation sizes are per sample.

A model whose inputs have a dynamic dimension (a sequence length, :mod:`dapple.models.shapes`)
may be measured at several lengths: :attr:`ModelProfile.by_length` then holds one
:class:`LengthProfile` per length, and the planner interpolates between them in tokens
(:mod:`dapple.cost.lengths`). A profile for a planned length distribution carries its layers
at the mean length (times, and the bytes that cross a cut) and, in
:attr:`ModelProfile.memory_at`, the layers at the longest length, which the memory model uses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapple.core._json import (
    as_float,
    check_schema_version,
    get_field,
    load_json_file,
    require,
    save_json_file,
)
from dapple.core.moe_profile import MoEProfile
from dapple.core.precision import TRAINING_PRECISIONS

__all__ = [
    "PROFILE_SCHEMA_VERSION",
    "AffineTime",
    "LayerProfile",
    "LengthProfile",
    "ModelProfile",
    "fit_affine",
]

PROFILE_SCHEMA_VERSION = 1


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


def _list(v: Any, what: str) -> list[Any]:
    require(isinstance(v, list), f"{what} must be a list, got {v!r}"[:200])
    return list(v)


def _optional_length(v: Any, what: str) -> float | None:
    if v is None:
        return None
    require(
        isinstance(v, (int, float)) and not isinstance(v, bool),
        f"{what} must be a number, got {v!r}",
    )
    return float(v) if isinstance(v, float) else int(v)


def _nonneg(v: Any, what: str) -> float:
    require(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
        f"{what} must be a finite number >= 0, got {v!r}",
    )
    return float(v)


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
        _nonneg(self.output_bytes_per_sample, f"layer {self.name!r}: output_bytes_per_sample")
        _nonneg(
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
            output_bytes_per_sample=_nonneg(
                get_field(d, "output_bytes_per_sample", what), f"{what}: output_bytes_per_sample"
            ),
            parameter_bytes=int(pb),
            kept_activation_bytes_per_sample=_nonneg(
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
            tied_layers=tuple(_list(d.get("tied_layers", []), f"{what}: tied_layers")),
            tensor_parallel=d.get("tensor_parallel", False),
            cast_parameter_bytes=d.get("cast_parameter_bytes"),
            moe=None if d.get("moe") is None else MoEProfile.from_dict(d["moe"], f"{what}.moe"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthProfile:
    """The layers of a model measured (or interpolated) at one length of its dynamic dimension."""

    seq_len: float
    """Length of the dynamic dimension (tokens per sample) the layers describe."""
    layers: tuple[LayerProfile, ...]
    """The layers in execution order, per-sample sizes at this length."""
    input_bytes_per_sample: float = 0.0
    """Bytes of the model's input per sample at this length."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.seq_len, (int, float))
            and not isinstance(self.seq_len, bool)
            and math.isfinite(self.seq_len)
            and self.seq_len > 0,
            f"LengthProfile.seq_len must be a finite number > 0, got {self.seq_len!r}",
        )
        require(len(self.layers) > 0, f"length {self.seq_len}: no layers")
        _nonneg(self.input_bytes_per_sample, f"length {self.seq_len}: input_bytes_per_sample")

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "input_bytes_per_sample": self.input_bytes_per_sample,
            "layers": [layer.to_dict() for layer in self.layers],
        }

    @staticmethod
    def from_dict(d: Any, what: str = "length") -> LengthProfile:
        require(isinstance(d, dict), f"{what} must be an object, got {d!r}"[:200])
        layers = get_field(d, "layers", what)
        require(
            isinstance(layers, list) and len(layers) > 0,
            f"{what}: layers must be a non-empty list, got {layers!r}"[:200],
        )
        n = get_field(d, "seq_len", what)
        require(
            isinstance(n, (int, float)) and not isinstance(n, bool),
            f"{what}: seq_len must be a number, got {n!r}",
        )
        return LengthProfile(
            seq_len=n,
            layers=tuple(LayerProfile.from_dict(x, i) for i, x in enumerate(layers)),
            input_bytes_per_sample=_nonneg(
                d.get("input_bytes_per_sample", 0.0), f"{what}: input_bytes_per_sample"
            ),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """A model as the ordered chain of profiled layers (N = len(layers))."""

    model_name: str
    """Name of the profiled model (zoo name, ``module:factory`` or file name)."""
    layers: tuple[LayerProfile, ...]
    """The layers in execution order."""
    input_bytes_per_sample: float = 0.0
    """Bytes of the model's input per sample (kept by stage 0 when it re-computes)."""
    dtype: str = "float32"
    """Element type the profile was measured with."""
    device: str = "unknown"
    """Device the profile was measured on (e.g. ``cpu``, ``NVIDIA H100``, ``V100 (analytic)``)."""
    batch_sizes: tuple[int, ...] = ()
    """Batch sizes the affine times were fitted from."""
    optimizer_state_factor: float = 3.0
    """Gradient + optimizer state held per parameter byte: 3.0 for fp32 Adam
    (grad, exp_avg, exp_avg_sq), so parameters take 4x their bytes in all (16 B per fp32 parameter)."""
    update_ms_per_parameter_byte: float = 0.0
    """U: time of one optimizer update (fused Adam, the runtime's) per byte of parameters on
    the profiled device, measured layer by layer by the profiler; 0: not measured (the cost
    model then has no update term)."""
    precision: str = "fp32"
    """Compute precision the layers were timed and their activations measured in: ``fp32``,
    or ``bf16``/``fp16`` autocast (parameters stay fp32; see :mod:`dapple.runtime.precision`).
    A profile without the field is fp32."""
    seq_len: float | None = None
    """Length of the dynamic dimension (tokens per sample) ``layers`` describe; None: the
    workload's own batches, no length stated."""
    by_length: tuple[LengthProfile, ...] = ()
    """The layers measured at each of several lengths, shortest first (``dapple profile
    --seq-lens``); empty: measured at one size."""
    memory_at: LengthProfile | None = None
    """The layers at the length the memory model plans for (the longest of a length
    distribution, :mod:`dapple.cost.lengths`); None: ``layers``."""
    model_fingerprint: str | None = None
    """A hash of the profiled model's layer count and its layers' tensor names, shapes and dtypes
    (:func:`dapple.models.fingerprint.model_fingerprint`): a command given this profile beside a
    model refuses another model of the same name and layer count. None (an analytic, imported
    or older profile): not checked."""
    tensor_widths: tuple[int, ...] | None = None
    """The tensor widths t the model's shardable layers can be cut over (a Hugging Face
    config's heads, key/value heads and MLP units each divisible by t); None: not recorded
    (an analytic, imported or older profile, a model without a Hugging Face config): the
    planner tries every width and the runtime checks the plan's."""
    schema_version: int = PROFILE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        require(len(self.layers) > 0, f"profile {self.model_name!r} has no layers")
        require(
            self.precision in TRAINING_PRECISIONS,
            f"profile {self.model_name!r}: precision must be one of "
            f"{', '.join(TRAINING_PRECISIONS)}, got {self.precision!r}",
        )
        require(
            all(b > 0 for b in self.batch_sizes),
            f"profile {self.model_name!r}: batch_sizes must be > 0, got {self.batch_sizes}",
        )
        _nonneg(self.input_bytes_per_sample, f"profile {self.model_name!r}: input_bytes_per_sample")
        _nonneg(self.optimizer_state_factor, f"profile {self.model_name!r}: optimizer_state_factor")
        _nonneg(
            self.update_ms_per_parameter_byte,
            f"profile {self.model_name!r}: update_ms_per_parameter_byte",
        )
        require(
            self.seq_len is None
            or (
                (isinstance(self.seq_len, (int, float)) and math.isfinite(self.seq_len))
                and self.seq_len > 0
            ),
            f"profile {self.model_name!r}: seq_len must be a number > 0, got {self.seq_len!r}",
        )
        lens = [x.seq_len for x in self.by_length]
        require(
            lens == sorted(set(lens)),
            f"profile {self.model_name!r}: by_length must have distinct lengths, shortest "
            f"first, got {lens}",
        )
        require(
            self.tensor_widths is None
            or all(isinstance(t, int) and not isinstance(t, bool) and t >= 1
                   for t in self.tensor_widths),
            f"profile {self.model_name!r}: tensor_widths must be integers >= 1, "
            f"got {self.tensor_widths!r}"[:200],
        )  # fmt: skip
        n = len(self.layers)
        for x in (*self.by_length, *([self.memory_at] if self.memory_at else [])):
            require(
                len(x.layers) == n,
                f"profile {self.model_name!r}: length {x.seq_len} has {len(x.layers)} layers, "
                f"the profile {n}",
            )
        for i, layer in enumerate(self.layers):
            require(
                all(t < n and t != i for t in layer.tied_layers),
                f"profile {self.model_name!r}: layer {i} ({layer.name!r}) is tied to layers "
                f"{list(layer.tied_layers)}; each must be another of its {n} layers",
            )

    @property
    def num_layers(self) -> int:
        """N, the number of layers."""
        return len(self.layers)

    @property
    def parameter_bytes(self) -> int:
        """Total parameter bytes of all layers."""
        return sum(layer.parameter_bytes for layer in self.layers)

    @property
    def seq_lens(self) -> tuple[float, ...]:
        """The lengths of :attr:`by_length` (empty: measured at one size)."""
        return tuple(x.seq_len for x in self.by_length)

    @property
    def for_memory(self) -> ModelProfile:
        """This profile with the layers of :attr:`memory_at` (itself when None): what the
        memory model reads (kept activations, stage inputs)."""
        m = self.memory_at
        if m is None:
            return self
        return dataclasses.replace(
            self,
            layers=m.layers,
            input_bytes_per_sample=m.input_bytes_per_sample,
            seq_len=m.seq_len,
            memory_at=None,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "model_name": self.model_name,
            "dtype": self.dtype,
            "device": self.device,
            "batch_sizes": list(self.batch_sizes),
            "input_bytes_per_sample": self.input_bytes_per_sample,
            "optimizer_state_factor": self.optimizer_state_factor,
            "precision": self.precision,
            "layers": [layer.to_dict() for layer in self.layers],
        }
        if self.update_ms_per_parameter_byte:
            out["update_ms_per_parameter_byte"] = self.update_ms_per_parameter_byte
        if self.seq_len is not None:
            out["seq_len"] = self.seq_len
        if self.by_length:
            out["by_length"] = [x.to_dict() for x in self.by_length]
        if self.memory_at is not None:
            out["memory_at"] = self.memory_at.to_dict()
        if self.model_fingerprint is not None:
            out["model_fingerprint"] = self.model_fingerprint
        if self.tensor_widths is not None:
            out["tensor_widths"] = list(self.tensor_widths)
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelProfile:
        what = "profile"
        check_schema_version(d, PROFILE_SCHEMA_VERSION, what)
        layers = get_field(d, "layers", what)
        require(
            isinstance(layers, list) and len(layers) > 0,
            f"{what}: layers must be a non-empty list, got {layers!r}"[:200],
        )
        bs = d.get("batch_sizes", [])
        fp = d.get("model_fingerprint")
        require(
            fp is None or isinstance(fp, str),
            f"{what}: model_fingerprint must be a string, got {fp!r}"[:200],
        )
        require(
            isinstance(bs, list) and all(isinstance(b, int) for b in bs),
            f"{what}: batch_sizes must be a list of integers, got {bs!r}",
        )
        return ModelProfile(
            model_name=str(get_field(d, "model_name", what)),
            dtype=str(d.get("dtype", "float32")),
            device=str(d.get("device", "unknown")),
            batch_sizes=tuple(bs),
            input_bytes_per_sample=_nonneg(
                d.get("input_bytes_per_sample", 0.0), f"{what}: input_bytes_per_sample"
            ),
            optimizer_state_factor=_nonneg(
                d.get("optimizer_state_factor", 3.0), f"{what}: optimizer_state_factor"
            ),
            update_ms_per_parameter_byte=_nonneg(
                d.get("update_ms_per_parameter_byte", 0.0),
                f"{what}: update_ms_per_parameter_byte",
            ),
            layers=tuple(LayerProfile.from_dict(x, i) for i, x in enumerate(layers)),
            precision=str(d.get("precision", "fp32")),
            seq_len=_optional_length(d.get("seq_len"), f"{what}: seq_len"),
            by_length=tuple(
                LengthProfile.from_dict(x, f"{what}: by_length[{i}]")
                for i, x in enumerate(_list(d.get("by_length", []), f"{what}: by_length"))
            ),
            memory_at=None
            if d.get("memory_at") is None
            else LengthProfile.from_dict(d["memory_at"], f"{what}: memory_at"),
            model_fingerprint=fp,
            tensor_widths=_optional_widths(d.get("tensor_widths"), f"{what}: tensor_widths"),
        )

    def save(self, path: str | Path) -> None:
        save_json_file(path, self.to_dict(), "profile")

    @staticmethod
    def load(path: str | Path) -> ModelProfile:
        """Load a profile JSON file.

        Raises:
            ValidationError: unreadable, malformed or invalid file (message names the field).
        """
        return ModelProfile.from_dict(load_json_file(path, "profile"))


def _optional_widths(value: Any, what: str) -> tuple[int, ...] | None:
    """A profile file's ``tensor_widths``: None, or a list of integers."""
    if value is None:
        return None
    require(
        isinstance(value, list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value),
        f"{what} must be a list of integers, got {value!r}"[:200],
    )
    return tuple(value)
