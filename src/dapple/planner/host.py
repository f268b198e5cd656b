"""A name of :mod:`dapple.cost.host` that callers outside the planner and the simulator import
from here: :data:`~dapple.cost.host.MIB`."""

from __future__ import annotations

from dapple.cost.host import MIB

__all__ = ["MIB"]
