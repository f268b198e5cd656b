"""The search options a plan was made with, recorded in the plan so a re-plan uses them again.

An elastic run that loses a device plans anew for the devices left
(:mod:`dapple.runtime.elastic`); it must search the same space the first plan came from -
ZeRO stage (or ``auto``), tensor widths, interleaving, planner - or the re-plan answers a
different question than the user asked. :func:`dapple.planner.make_plan` records them as
:attr:`dapple.core.plan.Plan.planned_with`; the lengths a plan was made for are the plan's own
``seq_len`` and ``max_seq_len``. Pure, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapple.core._json import require

__all__ = ["PlanningOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanningOptions:
    """What :func:`dapple.planner.make_plan` searched (its keyword arguments)."""

    planner: str = "dapple"
    """The planner (``dapple`` or a baseline)."""
    zero_stage: int = 0
    """0-3, or -1 (``ZERO_AUTO``): per stage, where memory asks for it."""
    tensor_widths: tuple[int, ...] | None = None
    """The tensor widths searched; None: the planner's default candidates."""
    interleaved: bool = False
    """Interleaved 1F1B plans were offered."""

    def __post_init__(self) -> None:
        require(isinstance(self.planner, str) and bool(self.planner),
                f"planned_with: planner must be a name, got {self.planner!r}")  # fmt: skip
        z = self.zero_stage
        require(isinstance(z, int) and not isinstance(z, bool) and -1 <= z <= 3,
                f"planned_with: zero_stage must be -1 (auto) or 0-3, got {z!r}")  # fmt: skip
        w = self.tensor_widths
        require(
            w is None or (isinstance(w, tuple) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in w)),
            f"planned_with: tensor_widths must be integers >= 1 or null, got {w!r}",
        )  # fmt: skip
        require(isinstance(self.interleaved, bool),
                f"planned_with: interleaved must be true or false, got {self.interleaved!r}")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "zero_stage": self.zero_stage,
            "tensor_widths": None if self.tensor_widths is None else list(self.tensor_widths),
            "interleaved": self.interleaved,
        }

    @staticmethod
    def from_dict(d: Any) -> PlanningOptions:
        require(isinstance(d, dict), f"planned_with must be an object, got {type(d).__name__}")
        w = d.get("tensor_widths")
        require(w is None or isinstance(w, list),
                f"planned_with: tensor_widths must be a list or null, got {w!r}")  # fmt: skip
        return PlanningOptions(
            planner=d.get("planner", "dapple"),
            zero_stage=d.get("zero_stage", 0),
            tensor_widths=None if w is None else tuple(w),
            interleaved=d.get("interleaved", False),
        )
