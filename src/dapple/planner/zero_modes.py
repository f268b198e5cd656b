"""The ways a scored stage's replicas may shard their state (ZeRO), as the scorer picks them.

A :class:`ZeroMode` is a ZeRO stage and, under ZeRO-3, whether the parameters are gathered once
per step or re-gathered per micro-batch, and the expert-parallel width that shards a
mixture-of-experts stage's experts over its replicas - the ``zero_stage``, ``regather`` and
``expert_width`` a :class:`~dapple.core.plan.StagePlan` records. Pure, no torch.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from dapple.core.precision import precision_of
from dapple.core.profile import ModelProfile

__all__ = ["UNSHARDED", "ZERO3_REGATHER", "ZeroMode", "zero3_modes"]


class ZeroMode(NamedTuple):
    """How a scored stage's replicas shard their state: a ZeRO stage and, under ZeRO-3, when
    the parameters are gathered, and its experts' width (the ``zero_stage``, ``regather`` and
    ``expert_width`` of a ``StagePlan``)."""

    stage: Literal[0, 1, 2, 3] = 0
    """0: unsharded; 1: the optimizer state sharded; 2: the gradients too; 3: the parameters
    too."""
    regather: bool = False
    """ZeRO-3 only: the parameters re-gathered per micro-batch, not once per step."""
    expert_width: int = 1
    """e_s: replicas over which each mixture-of-experts layer's experts are sharded (ZeRO 0,
    1 or 2, :mod:`dapple.planner.expert_width`); 1: every replica holds every expert."""


UNSHARDED = ZeroMode(0)
"""A stage whose replicas hold everything whole (one device, or no ZeRO)."""

ZERO3_REGATHER = ZeroMode(3, regather=True)
"""ZeRO-3, the parameters re-gathered per micro-batch."""


def zero3_modes(profile: ModelProfile, s: int = 0, e: int = 0) -> tuple[ZeroMode, ...]:
    """ZeRO-3's modes for layers [s, e) of ``profile``: gathered once per step, and
    re-gathered per micro-batch (:data:`ZERO3_REGATHER`) in fp32 only - under autocast the
    runtime's ZeRO-3 reduce-scatters once, after the step's last backward - and none for a
    stage holding a copy of a tied parameter, whose sum over the copies needs it whole
    (``dapple.runtime.parallel.stage_mesh``)."""
    if any(x.tied_parameter_bytes for x in profile.layers[s:e]):
        return ()
    once = ZeroMode(3)
    return (once,) if precision_of(profile.precision).autocast else (once, ZERO3_REGATHER)
