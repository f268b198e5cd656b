"""Device kinds of a mixed cluster: groups of servers whose devices differ in speed and memory.

Pure data, no torch. A cluster file may list ``kinds``, each a run of consecutive servers
(servers ``0 .. n_0 - 1`` are the first kind's, the next ``n_1`` the second's, ...), so a
device's kind follows from its server (:meth:`dapple.core.cluster.Cluster.kind_of`). Each kind
has:

* ``speed``: how fast its devices compute relative to the device the model profile was
  measured or modelled on (1.0: that device; 0.5: every F and B takes twice as long). Give it
  measured, or as ``datasheet`` (one of :data:`DATASHEET_TFLOPS`): the kind's peak dense
  16-bit Tensor Core FLOP/s over that of the cluster's ``profile_device``.
* its memory per device, in GiB (``device_memory_gib``), defaulting to the datasheet's.

One profile scaled by a speed is the model of a kind: layers whose time does not scale with
peak FLOP/s (memory-bound ones) are priced at the same ratio. A kind may instead carry its own
``profile`` (measured or computed on it, :mod:`dapple.core.kind_profiles`): its replicas then
take their per-layer times from it, at speed 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dapple.core._json import require
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.profile import ModelProfile, comparable_fingerprints
from dapple.errors import ValidationError

__all__ = [
    "DATASHEET_MEMORY_BYTES",
    "DATASHEET_TFLOPS",
    "DeviceKind",
    "check_cluster_kinds",
    "check_same_model",
    "kinds_from_dicts",
    "layerwise",
]

_GIB = 1024**3

DATASHEET_TFLOPS: dict[str, float] = {"v100": 125.0, "a100": 312.0, "h100": 989.4, "h200": 989.4}
"""Peak dense 16-bit Tensor Core TFLOP/s per datasheet device (the SXM parts; the same numbers
as :data:`dapple.profiler.analytic_devices.DEVICES`, whose module docstring cites the
datasheets)."""

DATASHEET_MEMORY_BYTES: dict[str, int] = {
    "v100": 16 * _GIB,
    "a100": 80 * _GIB,
    "h100": 80 * _GIB,
    "h200": 141 * 10**9,
}
"""Device memory of each datasheet device (the largest part: the A100 80GB, the V100 16GB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceKind:
    """One kind of device and the run of servers that hold it."""

    name: str
    """For reports, e.g. ``H100`` or ``A100-40GB``."""
    servers: int
    """Consecutive servers of this kind."""
    speed: float = 1.0
    """Compute speed relative to the profile's device (module docstring)."""
    device_memory_bytes: int
    """Memory of one device of this kind."""
    profile: ModelProfile | None = dataclasses.field(default=None, compare=False, repr=False)
    """The model's profile on this kind (its own per-layer times, speed 1); None: the one
    profile the cluster is planned with, scaled by ``speed``. Given beside the cluster file
    (:func:`~dapple.core.kind_profiles.with_kind_profiles`) or in it (the kind's ``profile``
    object, which :meth:`to_dict` writes)."""

    def __post_init__(self) -> None:
        what = f"device kind {self.name!r}"
        s = self.servers
        require(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1,
            f"{what}: servers must be an integer >= 1, got {s!r}",
        )
        v = self.speed
        require(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
            f"{what}: speed must be a finite number > 0, got {v!r}",
        )
        m = self.device_memory_bytes
        require(
            isinstance(m, int) and not isinstance(m, bool) and m > 0,
            f"{what}: device memory must be an integer > 0 bytes, got {m!r}",
        )
        require(
            self.profile is None or v == 1.0,
            f"{what}: a kind with its own profile has speed 1 (its own times), got speed {v!r}",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "servers": self.servers,
            "speed": self.speed,
            "device_memory_gib": self.device_memory_bytes / _GIB,
            **({} if self.profile is None else {"profile": self.profile.to_dict()}),
        }


_MIN_SPEED, _MAX_SPEED = 1e-4, 1e4
"""The speeds a cluster file may give: a device 10,000 times slower or faster than the
profile's is no device of this cluster's kind (a typo, or a profile of another device)."""
_MIN_GIB, _MAX_GIB = 2**-10, 2**30
"""The memory per device a cluster file may give, in GiB: 1 MiB to 1 EiB."""

_KIND_KEYS = {"name", "servers", "speed", "datasheet", "device_memory_gib", "profile"}


def _number(d: dict[str, Any], key: str, what: str) -> float:
    v = d[key]
    require(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        f"{what}: {key} must be a finite number, got {v!r}",
    )
    return float(v)


def _datasheet(name: Any, what: str, field: str) -> str:
    key = str(name).lower()
    require(
        key in DATASHEET_TFLOPS,
        f"{what}: unknown {field} {name!r}; known: {', '.join(DATASHEET_TFLOPS)}",
    )
    return key


def _kind_from_dict(d: Any, i: int, profile_device: str | None, cluster: str) -> DeviceKind:
    """Kind ``i`` of cluster ``cluster``'s file (module docstring)."""
    require(isinstance(d, dict), f"cluster {cluster!r}: kinds[{i}] must be an object, got {d!r}")
    name = d.get("name", f"kind{i}")
    require(
        isinstance(name, str) and name != "",
        f"cluster {cluster!r}: kinds[{i}]: name must be a non-empty string, got {name!r}"[:200],
    )
    what = f"cluster {cluster!r}, device kind {name!r}"
    unknown = sorted(set(d) - _KIND_KEYS)
    require(not unknown, f"{what}: unknown field(s) {unknown}; known: {sorted(_KIND_KEYS)}")
    require("servers" in d, f"{what}: missing field 'servers'")
    own = _kind_profile(d, what)
    sheet = _datasheet(d["datasheet"], what, "datasheet") if "datasheet" in d else None
    require(
        sheet is None or "speed" not in d,
        f"{what}: give speed or datasheet, not both (speed {d.get('speed')!r}, "
        f"datasheet {d.get('datasheet')!r})",
    )
    if sheet is not None:
        require(
            profile_device is not None,
            f"{what}: datasheet {sheet!r} gives a speed relative to the profile's device: name "
            f"it as the cluster's profile_device (one of {', '.join(DATASHEET_TFLOPS)})",
        )
        assert profile_device is not None
        speed = DATASHEET_TFLOPS[sheet] / DATASHEET_TFLOPS[profile_device]
    else:
        speed = _number(d, "speed", what) if "speed" in d else 1.0
        require(
            _MIN_SPEED <= speed <= _MAX_SPEED,
            f"{what}: speed must be from {_MIN_SPEED:g} to {_MAX_SPEED:g} (relative to the "
            f"profile's device), got {speed:g}",
        )
    if "device_memory_gib" in d:
        gib = _number(d, "device_memory_gib", what)
        require(
            _MIN_GIB <= gib <= _MAX_GIB,
            f"{what}: device_memory_gib must be from {_MIN_GIB:g} to {_MAX_GIB:g} GiB, got {gib:g}",
        )
        memory = int(gib * _GIB)
    else:
        require(
            sheet is not None,
            f"{what}: missing device_memory_gib (or a datasheet to take it from)",
        )
        assert sheet is not None
        memory = DATASHEET_MEMORY_BYTES[sheet]
    servers = d["servers"]
    require(
        isinstance(servers, int) and not isinstance(servers, bool),
        f"{what}: servers must be an integer, got {servers!r}",
    )
    return DeviceKind(name=name, servers=servers, speed=speed, device_memory_bytes=memory,
                      profile=own)  # fmt: skip


def _kind_profile(d: dict[str, Any], what: str) -> ModelProfile | None:
    """The kind's own ``profile`` object of a cluster file (None: not given); such a kind
    computes at its own times, so it gives no datasheet and no speed but 1.

    Raises:
        ValidationError: a datasheet or a speed other than 1 beside it, or a bad profile.
    """
    if "profile" not in d:
        return None
    require(
        "datasheet" not in d and d.get("speed", 1) == 1,
        f"{what}: a kind with its own profile computes at its own times: give no datasheet "
        f"and no speed but 1 (datasheet {d.get('datasheet')!r}, speed {d.get('speed')!r})",
    )
    try:
        return ModelProfile.from_dict(d["profile"])
    except (ValidationError, TypeError, AttributeError) as e:
        raise ValidationError(f"{what}: profile: {e}") from None


def kinds_from_dicts(items: Any, profile_device: Any, cluster: str) -> tuple[DeviceKind, ...]:
    """The ``kinds`` list of a cluster file, in server order.

    Args:
        items: the file's ``kinds``: a non-empty list of objects with ``name``, ``servers``,
            ``speed`` or ``datasheet``, and ``device_memory_gib`` (optional with a datasheet).
        profile_device: the file's ``profile_device`` (a :data:`DATASHEET_TFLOPS` name), or
            None; needed when a kind gives a datasheet.
        cluster: the cluster's name, for messages.

    Raises:
        ValidationError: a malformed kind, an unknown datasheet or profile device, a datasheet
            without a profile device, speed and datasheet both, two kinds of one name.
    """
    require(
        isinstance(items, list) and len(items) >= 1,
        f"cluster {cluster!r}: kinds must be a non-empty list of device kinds, got {items!r}"[:200],
    )
    ref = (
        None
        if profile_device is None
        else _datasheet(profile_device, f"cluster {cluster!r}", "profile_device")
    )
    kinds = tuple(_kind_from_dict(d, i, ref, cluster) for i, d in enumerate(items))
    names = [k.name for k in kinds]
    require(
        len(set(names)) == len(names), f"cluster {cluster!r}: device kinds named twice: {names}"
    )
    own = [k for k in kinds if k.profile is not None]
    require(
        not own or len(own) == len(kinds),
        f"cluster {cluster!r}: kinds {[k.name for k in own]} give their own profile and "
        f"{[k.name for k in kinds if k.profile is None]} do not: give one to every kind or none",
    )
    for k in own[1:]:
        assert own[0].profile is not None and k.profile is not None
        check_same_model(own[0].profile, own[0].name, k.profile, k.name)
    return kinds


def check_same_model(ref: ModelProfile, ref_kind: str, p: ModelProfile, kind: str) -> None:
    """Refuse, in one line, profiles of two kinds that are of two models (layer count, layer
    names, fingerprint) or measured at several lengths.

    Raises:
        ValidationError: naming both kinds and the first difference.
    """
    what = f"profiles of kinds {ref_kind!r} ({ref.model_name}) and {kind!r} ({p.model_name})"
    require(
        ref.num_layers == p.num_layers,
        f"{what} are of different models: {ref.num_layers} vs {p.num_layers} layers",
    )
    names = [x.name for x in ref.layers], [x.name for x in p.layers]
    bad = next((i for i, (a, b) in enumerate(zip(*names, strict=True)) if a != b), None)
    require(
        bad is None,
        f"{what} are of different models: layer {bad} is {names[0][bad or 0]!r} vs "
        f"{names[1][bad or 0]!r}",
    )
    a, b = ref.model_fingerprint, p.model_fingerprint
    require(
        not comparable_fingerprints(a, b) or a == b,
        f"{what} are of different models: fingerprints {a} vs {b}",
    )
    require(
        not ref.by_length and not p.by_length,
        f"{what}: per-kind profiles measured at several lengths are not supported; give "
        "each kind a profile at one length",
    )


def _pick(times: list[AffineTime], pick: Callable[[list[float]], float]) -> AffineTime:
    return AffineTime(
        fixed_ms=pick([t.fixed_ms for t in times]),
        per_sample_ms=pick([t.per_sample_ms for t in times]),
    )


def layerwise(
    base: ModelProfile,
    profiles: Sequence[ModelProfile],
    pick: Callable[[list[float]], float],
) -> ModelProfile:
    """``base`` with each layer's forward and backward (and their split, where every profile
    has it) at ``pick`` (``min``, ``max``) of ``profiles``' fixed times and, separately, of
    their per-sample times: with ``max`` no profile computes a layer slower on any number of
    samples, with ``min`` none faster. Sizes and everything else are ``base``'s.

    Args:
        base: the profile whose sizes are kept.
        profiles: profiles of one model (:func:`check_same_model`), at least one.
        pick: how the layer's times of the profiles make one.
    """
    layers: list[LayerProfile] = []
    for i, layer in enumerate(base.layers):
        them = [p.layers[i] for p in profiles]
        changes: dict[str, AffineTime | None] = {
            "forward": _pick([x.forward for x in them], pick),
            "backward": _pick([x.backward for x in them], pick),
        }
        for f in ("backward_input", "backward_weight"):
            split = [getattr(x, f) for x in them]
            changes[f] = None if any(t is None for t in split) else _pick(split, pick)
        layers.append(dataclasses.replace(layer, **changes))  # type: ignore[arg-type]
    return dataclasses.replace(base, layers=tuple(layers))


def check_cluster_kinds(
    kinds: tuple[DeviceKind, ...], servers: int, memory: int, reserved: int, cluster: str
) -> None:
    """Check a cluster's kinds against its other fields.

    Args:
        kinds: :attr:`~dapple.core.cluster.Cluster.kinds`.
        servers: the cluster's servers, which the kinds' must sum to.
        memory: the cluster's device memory in bytes, which must be the smallest kind's.
        reserved: the memory the runtime reserves per device, which each kind must exceed.
        cluster: its name, for messages.

    Raises:
        ValidationError: a kind that is not a :class:`DeviceKind`, or a mismatch above.
    """
    what = f"cluster {cluster!r}"
    require(
        all(isinstance(k, DeviceKind) for k in kinds),
        f"{what}: kinds must be DeviceKind records, got {kinds!r}"[:200],
    )
    n = sum(k.servers for k in kinds)
    require(
        n == servers,
        f"{what}: its device kinds hold {n} servers "
        f"({', '.join(f'{k.name}: {k.servers}' for k in kinds)}), the cluster {servers}",
    )
    low = min(k.device_memory_bytes for k in kinds)
    require(
        memory == low,
        f"{what}: device memory {memory / _GIB:g} GiB must be the smallest kind's, "
        f"{low / _GIB:g} GiB",
    )
    require(
        reserved < low,
        f"{what}: reserved memory {reserved} bytes leaves nothing of the smallest kind's {low}",
    )
