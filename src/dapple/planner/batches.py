"""Micro-batch counts M a planner tries for a global batch size, the size's limit, and the
message when no plan fits. Pure, no torch."""

from __future__ import annotations

import bisect
import math

from dapple.core.cluster import Cluster
from dapple.core.profile import ModelProfile
from dapple.cost.memory import state_bytes_per_parameter_byte
from dapple.errors import InfeasibleError, ValidationError
from dapple.planner.idle_kinds import unfit_kinds_clause

__all__ = [
    "DENSE_MICRO_BATCH_COUNTS",
    "DIVISOR_SCAN",
    "MAX_GLOBAL_BATCH_SIZE",
    "MAX_MICRO_BATCH_COUNTS",
    "check_batch_argument",
    "check_global_batch_size",
    "divisors",
    "infeasible_message",
    "micro_batch_candidates",
]


MAX_MICRO_BATCH_COUNTS = 64
"""Most candidate M a planner tries for one global batch size (every planner's work is
proportional to it, never to the global batch size itself)."""
DENSE_MICRO_BATCH_COUNTS = 32
"""Every divisor M up to this is a candidate: there one more micro-batch changes the bubble
share ``(S - 1) / (M + S - 1)`` of the step most."""
MAX_GLOBAL_BATCH_SIZE = 2**53
"""Largest global batch size planned: the cost model counts samples in floating point, exact
for integers up to 2^53."""
DIVISOR_SCAN = 1 << 16
"""Trial divisions spent finding the divisors of the global batch size G: every M with
``M <= DIVISOR_SCAN`` or ``G / M <= DIVISOR_SCAN`` (few micro-batches, or small ones) is found;
that is every divisor when ``G <= DIVISOR_SCAN**2``."""


def divisors(n: int, scan: int | None = None) -> list[int]:
    """Positive divisors of ``n`` in increasing order, by trial division up to sqrt(n).

    Args:
        n: a positive integer.
        scan: try only the divisors ``d <= scan``: the result is every divisor d with
            ``d <= scan`` or ``n / d <= scan`` (all of them when ``n <= scan**2``), found in
            at most ``scan`` divisions whatever ``n``; None: sqrt(n) divisions, every divisor.
    """
    top = math.isqrt(n) if scan is None else min(math.isqrt(n), scan)
    low = [d for d in range(1, top + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if n // d > top]


def check_global_batch_size(global_batch_size: int) -> None:
    """Refuse a global batch size above :data:`MAX_GLOBAL_BATCH_SIZE`.

    Raises:
        ValidationError: naming the size and the limit.
    """
    if global_batch_size > MAX_GLOBAL_BATCH_SIZE:
        digits = str(global_batch_size)
        shown = digits if len(digits) <= 24 else f"{digits[:6]}... ({len(digits)} digits)"
        raise ValidationError(
            f"global batch size {shown} is above the largest the planner "
            f"handles, 2^53 = {MAX_GLOBAL_BATCH_SIZE:,} (samples are counted in floating point)"
        )


def check_batch_argument(global_batch_size: object) -> None:
    """Refuse a global batch size that is not an integer >= 1, or one above the limit
    (:func:`check_global_batch_size`): what a planner's caller passes, before any search.

    Raises:
        ValidationError: naming the value.
    """
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValidationError(
            f"global batch size must be an integer >= 1, got {global_batch_size!r}"
        )
    check_global_batch_size(global_batch_size)


def micro_batch_candidates(
    global_batch_size: int, limit: int = MAX_MICRO_BATCH_COUNTS
) -> list[int]:
    """Candidate M: divisors of the global batch size G, at most ``limit`` of them.

    The divisors found by :data:`DIVISOR_SCAN` trial divisions (all of them for G up to 2^32);
    when they are more than ``limit``: every one up to :data:`DENSE_MICRO_BATCH_COUNTS` (in
    at most half the slots), and for the other slots the divisors nearest to targets evenly
    spaced in log M up to M = G (always kept), so a planner's work does not grow with G.

    Raises:
        InfeasibleError: the global batch size is not a positive integer.
        ValidationError: it is above :data:`MAX_GLOBAL_BATCH_SIZE`.
    """
    if global_batch_size < 1:
        raise InfeasibleError(f"global batch size must be >= 1, got {global_batch_size}")
    check_global_batch_size(global_batch_size)
    found = divisors(global_batch_size, DIVISOR_SCAN)
    if len(found) <= limit:
        return found
    picked = set(found[: min(limit // 2, bisect.bisect_right(found, DENSE_MICRO_BATCH_COUNTS))])
    rest = found[len(picked) :]
    logs = [math.log(m) for m in rest]
    slots = limit - len(picked)
    for k in range(1, slots + 1):  # targets up to log G, the last one M = G itself
        target = logs[0] + (logs[-1] - logs[0]) * k / slots
        i = bisect.bisect_left(logs, target)
        near = [j for j in (i - 1, i) if 0 <= j < len(rest)]
        picked.add(rest[min(near, key=lambda j: abs(logs[j] - target))])
    return sorted(picked)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def infeasible_message(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> str:
    """One line saying that no plan of ``profile`` fits ``cluster`` at this batch size, with
    the model's state and the largest layer's need beside the device memory, and the device
    kinds no layer fits (:func:`~dapple.planner.idle_kinds.unfit_kinds_clause`)."""
    f = state_bytes_per_parameter_byte(profile)
    state = profile.parameter_bytes * f
    r = cluster.reserved_memory_bytes
    reserved = f" ({_bytes(r)} of each reserved for the runtime)" if r else ""
    need = max(
        layer.parameter_bytes * f + layer.kept_activation_bytes_per_sample
        for layer in profile.for_memory.layers
    )
    dps = cluster.devices_per_server
    devices = (
        f"{cluster.num_devices} devices ("
        + ", ".join(f"{k.name}: {k.servers * dps} of {_bytes(k.device_memory_bytes)}"
                    for k in cluster.kinds)
        + ")"
        if cluster.kinds
        else f"{cluster.num_devices} devices of {_bytes(cluster.device_memory_bytes)}"
    )  # fmt: skip
    return (
        f"no plan of {profile.model_name!r} ({profile.num_layers} layers, "
        f"{_bytes(state)} of parameters+gradients+optimizer state; one layer alone needs up to "
        f"{_bytes(need)} with one sample) fits {devices}{reserved} with global batch size "
        f"{global_batch_size}{unfit_kinds_clause(profile, cluster)}"
    )
