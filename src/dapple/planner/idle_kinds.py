"""The device kinds of a mixed cluster a plan leaves idle, and why (issue #43). Pure, no torch.

A plan may leave a whole kind unused; the planner says which kind, how many devices and why
(:func:`idle_kinds`), the first reason that holds:

* memory: no layer alone holds one sample on one of its devices (:func:`layer_needs` against
  the kind's usable memory), so the search could place nothing there;
* the batch: a global batch of B keeps at most U devices busy
  (:func:`~dapple.core.usable.usable_devices`), and the search looked at the cluster's first
  servers only (:func:`~dapple.core.usable.usable_cluster`), the kind's beyond them;
* speed: the search found no faster plan using them (said with how many layers fit them alone
  when some do not).

When no plan fits at all, :func:`unfit_kinds_clause` names the kinds that could hold nothing.
"""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.device_kinds import DeviceKind
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.core.usable import usable_cluster, usable_devices
from dapple.cost.peak_memory import stage_bytes

__all__ = ["idle_kinds", "layer_needs", "unfit_kinds_clause"]

_GIB = 1024**3


def _gib(n: float) -> str:
    return f"{n / _GIB:.3g} GiB"


def layer_needs(profile: ModelProfile) -> list[float]:
    """Per layer, the least memory a stage of that layer alone needs on one device for one
    micro-batch of one sample (M = 1, unsharded, with or without re-computation): below it
    :func:`~dapple.cost.peak_memory.in_flight_limit` holds no micro-batch."""
    return [
        min(
            sb.static + sb.shared + max(sb.first, 0.0, sb.grads - sb.cache)
            for sb in stage_bytes(profile, (i, i + 1), 1)
        )
        for i in range(profile.num_layers)
    ]


def _kind_devices(cluster: Cluster) -> list[tuple[DeviceKind, range]]:
    """Each kind with its device ids, in server order."""
    out, first, dps = [], 0, cluster.devices_per_server
    for k in cluster.kinds:
        out.append((k, range(first, first + k.servers * dps)))
        first += k.servers * dps
    return out


def _usable(cluster: Cluster, k: DeviceKind) -> int:
    return k.device_memory_bytes - cluster.reserved_memory_bytes


def idle_kinds(
    plan: Plan, profile: ModelProfile, cluster: Cluster, widths: list[int] | None = None
) -> list[str]:
    """One line per device kind of ``cluster`` none of whose devices ``plan`` uses: the kind,
    its device count and why (module docstring); empty on a cluster without kinds.

    Args:
        plan: the plan.
        profile: the model profile it was made for.
        cluster: the cluster it was made on.
        widths: the tensor widths the search looked at (None: 1).
    """
    if not cluster.kinds:
        return []
    used = set(plan.devices)
    U = usable_devices(profile.num_layers, plan.global_batch_size, widths or [1])
    searched = usable_cluster(cluster, U).num_devices
    fastest = max(k.speed for k in cluster.kinds)
    needs = layer_needs(profile)
    lines = []
    for k, devices in _kind_devices(cluster):
        if used.intersection(devices):
            continue
        usable = _usable(cluster, k)
        fit = sum(n <= usable for n in needs)
        pace = (
            "priced by their own profile"
            if k.profile is not None
            else f"speed {k.speed / fastest:.2f} of the fastest kind"
        )
        if fit == 0:
            why = (
                f"no layer alone holds one sample in their {_gib(usable)} usable (the smallest "
                f"needs {_gib(min(needs))})"
            )
        elif devices[0] >= searched:
            why = (
                f"a global batch of {plan.global_batch_size} keeps at most {U:,} devices busy, "
                f"the search looked at the first {searched:,}"
            )
        elif fit < len(needs):
            why = (
                f"only {fit} of {len(needs)} layers alone hold one sample in their "
                f"{_gib(usable)} usable (the largest needs {_gib(max(needs))}), and the search "
                f"found no faster plan using them ({pace})"
            )
        else:
            why = f"the search found no faster plan using them ({pace})"
        lines.append(f"device kind {k.name}: its {len(devices):,} devices left idle: {why}")
    return lines


def unfit_kinds_clause(profile: ModelProfile, cluster: Cluster) -> str:
    """For a "no plan fits" message: ``"; device kind(s) K (n devices of m GiB) could not be
    used: ..."`` naming each kind no layer alone fits (:func:`layer_needs`), or ``""`` (no
    kinds, or each kind holds some layer)."""
    needs = layer_needs(profile) if cluster.kinds else []
    low = min(needs, default=0.0)
    unfit = [(k, len(d)) for k, d in _kind_devices(cluster) if _usable(cluster, k) < low]
    if not unfit:
        return ""
    names = ", ".join(
        f"{k.name} ({n:,} devices of {_gib(k.device_memory_bytes)})" for k, n in unfit
    )
    return (
        f"; device kind(s) {names} could not be used: no layer alone holds one sample there "
        f"(the smallest needs {_gib(low)})"
    )
