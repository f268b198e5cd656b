"""A model's profile (paper section 3.3): the chain of its profiled layers, with its JSON file.

Pure data model, no torch. A :class:`ModelProfile` is the ordered chain of
:class:`~dapple.core.layer_profile.LayerProfile` (each layer's affine times, activation and
parameter sizes) with what holds for the whole model: its input, precision, optimizer state
and update time.

A model whose inputs have a dynamic dimension (a sequence length, :mod:`dapple.models.shapes`)
may be measured at several lengths: :attr:`ModelProfile.by_length` then holds one
:class:`LengthProfile` per length, and the planner interpolates between them in tokens
(:mod:`dapple.cost.at_length`). A profile for a planned length distribution carries its layers
at the mean length (times, and the bytes that cross a cut) and, in
:attr:`ModelProfile.memory_at`, the layers at the longest length, which the memory model uses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapple.core._json import (
    as_list,
    as_nonneg,
    check_schema_version,
    get_field,
    load_json_file,
    require,
    save_json_file,
)
from dapple.core.layer_profile import LayerProfile
from dapple.core.precision import TRAINING_PRECISIONS

__all__ = [
    "PROFILE_CLOCKS",
    "PROFILE_SCHEMA_VERSION",
    "LengthProfile",
    "ModelProfile",
    "comparable_fingerprints",
]

PROFILE_SCHEMA_VERSION = 1

PROFILE_CLOCKS = ("wall", "cpu")
"""What a profile's times were measured in (:attr:`ModelProfile.clock`)."""

_CPU_CLOCK_DEVICE = "cpu (CPU time, "
"""How a co-worker profile's ``device`` reads (:func:`dapple.profiler.measure.profile_workload`):
a file without ``clock`` whose device starts so was measured in CPU time."""


def comparable_fingerprints(a: str | None, b: str | None) -> bool:
    """Whether two model fingerprints (:attr:`ModelProfile.model_fingerprint`) can be held
    against each other: both recorded, of one kind (the text before ``:``: ``meta-state-v1``
    hashes a model's tensors, ``analytic-spec-v1`` an analytic profile's shapes; none without
    a ``:``)."""

    def kind(fp: str) -> str:
        return fp.partition(":")[0] if ":" in fp else ""

    return a is not None and b is not None and kind(a) == kind(b)


def _optional_length(v: Any, what: str) -> float | None:
    if v is None:
        return None
    require(
        isinstance(v, (int, float)) and not isinstance(v, bool),
        f"{what} must be a number, got {v!r}",
    )
    return float(v) if isinstance(v, float) else int(v)


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
        as_nonneg(self.input_bytes_per_sample, f"length {self.seq_len}: input_bytes_per_sample")

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
            input_bytes_per_sample=as_nonneg(
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
    distribution, :mod:`dapple.cost.at_length`); None: ``layers``."""
    model_fingerprint: str | None = None
    """A measured profile's hash of its model's layer count and its layers' tensor names, shapes
    and dtypes (``meta-state-v1:``, :func:`dapple.models.fingerprint.model_fingerprint`): a
    command given this profile beside a model refuses another model of the same name and layer
    count. An analytic profile's hash of its layer count and the shapes it counted
    (``analytic-spec-v1:``, :func:`dapple.profiler.analytic_models.spec_fingerprint`): held
    only against a plan made from an analytic profile. None (an imported or older profile):
    not checked."""
    tensor_widths: tuple[int, ...] | None = None
    """The tensor widths t the model's shardable layers can be cut over (a Hugging Face
    config's heads, key/value heads and MLP units each divisible by t); None: not recorded
    (an analytic, imported or older profile, a model without a Hugging Face config): the
    planner tries every width and the runtime checks the plan's."""
    clock: str = "wall"
    """What the layer times measure: ``wall`` time (CUDA events, or a CPU process's wall
    clock), or ``cpu``, the CPU time of the profiling thread (a profile taken among co-workers,
    :func:`dapple.profiler.measure.profile_workload`): time while scheduled, without waiting
    for a core, which ``Cluster.lone_wall_per_cpu`` turns into wall time."""
    schema_version: int = PROFILE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        require(len(self.layers) > 0, f"profile {self.model_name!r} has no layers")
        require(
            self.clock in PROFILE_CLOCKS,
            f"profile {self.model_name!r}: clock must be one of {', '.join(PROFILE_CLOCKS)}, "
            f"got {self.clock!r}"[:200],
        )
        require(
            self.precision in TRAINING_PRECISIONS,
            f"profile {self.model_name!r}: precision must be one of "
            f"{', '.join(TRAINING_PRECISIONS)}, got {self.precision!r}",
        )
        require(
            all(b > 0 for b in self.batch_sizes),
            f"profile {self.model_name!r}: batch_sizes must be > 0, got {self.batch_sizes}",
        )
        as_nonneg(
            self.input_bytes_per_sample, f"profile {self.model_name!r}: input_bytes_per_sample"
        )
        as_nonneg(
            self.optimizer_state_factor, f"profile {self.model_name!r}: optimizer_state_factor"
        )
        as_nonneg(
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
        if self.clock != "wall":
            out["clock"] = self.clock
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
        device = str(d.get("device", "unknown"))
        return ModelProfile(
            model_name=str(get_field(d, "model_name", what)),
            dtype=str(d.get("dtype", "float32")),
            device=device,
            clock=str(d.get("clock", "cpu" if device.startswith(_CPU_CLOCK_DEVICE) else "wall")),
            batch_sizes=tuple(bs),
            input_bytes_per_sample=as_nonneg(
                d.get("input_bytes_per_sample", 0.0), f"{what}: input_bytes_per_sample"
            ),
            optimizer_state_factor=as_nonneg(
                d.get("optimizer_state_factor", 3.0), f"{what}: optimizer_state_factor"
            ),
            update_ms_per_parameter_byte=as_nonneg(
                d.get("update_ms_per_parameter_byte", 0.0),
                f"{what}: update_ms_per_parameter_byte",
            ),
            layers=tuple(LayerProfile.from_dict(x, i) for i, x in enumerate(layers)),
            precision=str(d.get("precision", "fp32")),
            seq_len=_optional_length(d.get("seq_len"), f"{what}: seq_len"),
            by_length=tuple(
                LengthProfile.from_dict(x, f"{what}: by_length[{i}]")
                for i, x in enumerate(as_list(d.get("by_length", []), f"{what}: by_length"))
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
