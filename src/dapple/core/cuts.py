"""A plan's cuts moved: the same stages, replication and placement on other layer ranges."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from dapple.core.plan import Plan

__all__ = ["rounded_to_chunks", "with_cuts"]


def with_cuts(plan: Plan, cuts: Sequence[int]) -> Plan:
    """``plan`` with (virtual) stage k on layers ``[cuts[k], cuts[k + 1])``, all else kept."""
    stages = tuple(
        dataclasses.replace(st, layers=(cuts[k], cuts[k + 1])) for k, st in enumerate(plan.stages)
    )
    return dataclasses.replace(plan, stages=stages)


def rounded_to_chunks(plan: Plan, v: int) -> Plan | None:
    """``plan`` with every cut moved to the nearest multiple of v, so each device group holds a
    multiple of v layers (:func:`interleave` can then cut it into v chunks); None when
    impossible (an interleaved plan, v does not divide the layers, or two cuts would meet)."""
    N = plan.num_layers
    if plan.virtual_stages != 1 or N % v:
        return None
    cuts = [0, *(v * round(c / v) for c in plan.split_positions), N]
    if any(b <= a for a, b in itertools.pairwise(cuts)):
        return None
    return with_cuts(plan, cuts)
