"""A name of :mod:`dapple.cost.lengths` that callers outside the planner and the simulator
import from here: :func:`~dapple.cost.lengths.profile_for_lengths`."""

from __future__ import annotations

from dapple.cost.lengths import profile_for_lengths

__all__ = ["profile_for_lengths"]
