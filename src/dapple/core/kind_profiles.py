"""Per-kind profiles of a mixed cluster: each device kind's own profile of one model.

Pure, no torch. One profile scaled by a kind's ``speed`` prices every layer at the same ratio;
a layer bound by memory bandwidth and one bound by FLOP/s do not scale alike between devices.
Given a profile per kind (measured on it, or ``dapple profile --analytic KIND``),
:func:`with_kind_profiles` puts each on its kind (:attr:`DeviceKind.profile
<dapple.core.device_kinds.DeviceKind.profile>`, speed 1): a replica then computes at its own
kind's per-layer times (:func:`profile_of`), in the cost model, the simulator and the
planner's shares (:mod:`dapple.planner.shares`). The planner searches with
:func:`fastest_layers`, each layer at its fastest kind's time, so that its bounds stay
lower bounds.

On the command line the kinds' profiles are one spec, ``KIND=FILE`` per kind
(:func:`parse_profile_set`): ``--profile H100=h100.json --profile A100=a100.json``, or
``profile = "H100=h100.json,A100=a100.json"`` in a config file. A cluster with them saves them
in its file (each kind's ``profile``, :meth:`~dapple.core.cluster.Cluster.save`), and such a
file gives them back when loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from dapple.core._json import require
from dapple.core.cluster import Cluster
from dapple.core.device_kinds import check_same_model, layerwise
from dapple.core.profile import ModelProfile

__all__ = [
    "fastest_layers",
    "has_kind_profiles",
    "parse_profile_set",
    "profile_of",
    "with_kind_profiles",
]


def parse_profile_set(spec: str) -> dict[str, str] | None:
    """The ``KIND=FILE`` pairs of a profile spec, in order; None for one profile (a file or
    ``paper:NAME``: no ``=`` in it).

    Raises:
        ValidationError: a part without ``=``, an empty kind or file, a kind named twice.
    """
    if "=" not in spec:
        return None
    out: dict[str, str] = {}
    for part in spec.split(","):
        kind, sep, path = part.partition("=")
        kind, path = kind.strip(), path.strip()
        require(
            sep == "=" and kind != "" and path != "",
            f"profile set {spec!r}: each part must be KIND=FILE, got {part!r}",
        )
        require(kind not in out, f"profile set {spec!r}: kind {kind!r} given twice")
        out[kind] = path
    return out


def with_kind_profiles(cluster: Cluster, profiles: Mapping[str, ModelProfile]) -> Cluster:
    """``cluster`` with each kind given its profile (speed 1: its own times).

    Args:
        cluster: a cluster with device kinds.
        profiles: one profile per kind name, every kind's, all of one model.

    Raises:
        ValidationError: a cluster without kinds, a name that is no kind of it, a kind without
            a profile, or profiles of different models (layers, names or fingerprints).
    """
    what = f"cluster {cluster.name!r}"
    names = [k.name for k in cluster.kinds]
    require(
        bool(names),
        f"{what} has no device kinds: per-kind profiles {sorted(profiles)} need a cluster "
        "file with kinds (give one profile)",
    )
    for x in profiles:
        require(x in names, f"{what}: no device kind {x!r} (its kinds: {', '.join(names)})")
    for x in names:
        require(
            x in profiles,
            f"{what}: device kind {x!r} has no profile; give one per kind "
            f"({', '.join(f'{n}=FILE' for n in names)})",
        )
    first = names[0]
    for x in names[1:]:
        check_same_model(profiles[first], first, profiles[x], x)
    kinds = tuple(
        dataclasses.replace(k, speed=1.0, profile=profiles[k.name]) for k in cluster.kinds
    )
    return dataclasses.replace(cluster, kinds=kinds)


def has_kind_profiles(cluster: Cluster) -> bool:
    """Whether the cluster's kinds carry their own profiles (:func:`with_kind_profiles`)."""
    return any(k.profile is not None for k in cluster.kinds)


def profile_of(cluster: Cluster, device: int, profile: ModelProfile) -> ModelProfile:
    """The profile device ``device`` computes at: its kind's own, else ``profile``."""
    if not cluster.kinds:
        return profile
    k = cluster.kind_of(device)
    return profile if k is None or k.profile is None else k.profile


def fastest_layers(profile: ModelProfile, cluster: Cluster) -> ModelProfile:
    """``profile`` with each layer's forward and backward (and their split) at the least
    fixed and per-sample time of any kind's profile: on any number of samples no kind
    computes a layer faster. Sizes and everything else are ``profile``'s. ``profile`` itself
    on a cluster without per-kind profiles."""
    own = [k.profile for k in cluster.kinds if k.profile is not None]
    return layerwise(profile, own, min) if own else profile
