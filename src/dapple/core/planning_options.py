"""The options a plan was asked for with, recorded in the plan so a re-plan uses them again.

An elastic run that loses a device plans anew for the devices left
(:mod:`dapple.runtime.launch.elastic`); it must search the same space the first plan came from -
ZeRO stage (or ``auto``), tensor widths, interleaving, planner - and put the result under the
schedule asked for, or the re-plan answers a different question than the user asked.
:func:`dapple.planner.make_plan` records the search options as
:attr:`dapple.core.plan.Plan.planned_with`, :func:`dapple.api.plan` and ``dapple plan`` the
schedule too. With the plan's own global batch size and lengths (``mean_seq_len``,
``max_seq_len``) they are every option of the
:class:`~dapple.planner.plan_config.PlanConfig` the plan was made with
(:func:`~dapple.planner.plan_config.config_of`); the rest of it names the inputs (profile,
cluster, servers) and the output file. Pure, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dapple.core._json import require

__all__ = ["NONFINITE_MODES", "ZERO_CHOICES", "PlanningOptions", "ZeroChoice", "zero_choice"]

ZeroChoice = Literal[0, 1, 2, 3, "auto"]
"""The ZeRO stage a plan is searched with: 0, 1 (ZeRO-1), 2 (ZeRO-2), 3 (ZeRO-3, gathering the
parameters once per step or per micro-batch, whichever L prefers) on every replicated stage,
or ``auto``: per stage, where memory asks for it. A stage with one replica stays at 0."""

ZERO_CHOICES: tuple[ZeroChoice, ...] = (0, 1, 2, 3, "auto")
"""Every :data:`ZeroChoice`, in the order messages list them."""

_OLD_AUTO = -1
"""``auto`` as plan files of earlier versions store it in ``planned_with.zero_stage``."""
_OLD_INTERLEAVE = "interleaved"
"""The key plan files of earlier versions record ``planned_with.interleave`` under."""


def zero_choice(value: object) -> ZeroChoice | None:
    """The :data:`ZeroChoice` equal to ``value``; None for any other value (a bool too)."""
    if isinstance(value, bool):
        return None
    return next((z for z in ZERO_CHOICES if z == value), None)


NONFINITE_MODES = ("stop", "skip", "off")
"""What a run does at a non-finite loss or gradient (``--on-nonfinite``): stop or skip under
the guard, every rank waiting for its verdict; off: no guard."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanningOptions:
    """What :func:`dapple.planner.make_plan` searched (its keyword arguments), and the schedule
    its plan was then put under."""

    planner: str = "dapple"
    """The planner (``dapple`` or a baseline)."""
    zero_stage: ZeroChoice = 0
    """0-3 on every replicated stage, or ``auto``: per stage, where memory asks for it."""
    tensor_widths: tuple[int, ...] | None = None
    """The tensor widths searched; None: the planner's default candidates."""
    interleave: bool = False
    """Interleaved 1F1B plans were offered (``dapple plan --interleave``)."""
    schedule: str | None = None
    """The schedule the planned stages were put under (``dapple plan --schedule``), or ``best``;
    None: the planner's choice."""
    virtual_stages: int = 1
    """v, model chunks per device group asked for with ``schedule`` ``interleaved``."""
    on_nonfinite: str = "stop"
    """The run's non-finite mode the schedules were simulated with (``off``: no step
    collective)."""

    def __post_init__(self) -> None:
        require(isinstance(self.planner, str) and bool(self.planner),
                f"planned_with: planner must be a name, got {self.planner!r}")  # fmt: skip
        z = self.zero_stage
        require(isinstance(z, int | str) and zero_choice(z) is not None,
                f"planned_with: zero_stage must be 0-3 or auto, got {z!r}")  # fmt: skip
        w = self.tensor_widths
        require(
            w is None or (isinstance(w, tuple) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in w)),
            f"planned_with: tensor_widths must be integers >= 1 or null, got {w!r}",
        )  # fmt: skip
        require(isinstance(self.interleave, bool),
                f"planned_with: interleave must be true or false, got {self.interleave!r}")  # fmt: skip
        require(self.schedule is None or (isinstance(self.schedule, str) and bool(self.schedule)),
                f"planned_with: schedule must be a name or null, got {self.schedule!r}")  # fmt: skip
        v = self.virtual_stages
        require(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                f"planned_with: virtual_stages must be an integer >= 1, got {v!r}")  # fmt: skip
        require(self.on_nonfinite in NONFINITE_MODES,
                f"planned_with: on_nonfinite must be stop, skip or off, got {self.on_nonfinite!r}")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The ``planned_with`` object of a plan file; ``schedule`` and ``virtual_stages`` only
        where asked for (the planner's choice leaves them out, as earlier versions wrote it)."""
        d: dict[str, Any] = {
            "planner": self.planner,
            "zero_stage": self.zero_stage,
            "tensor_widths": None if self.tensor_widths is None else list(self.tensor_widths),
            "interleave": self.interleave,
        }
        if self.schedule is not None:
            d["schedule"] = self.schedule
        if self.virtual_stages != 1:
            d["virtual_stages"] = self.virtual_stages
        if self.on_nonfinite != "stop":
            d["on_nonfinite"] = self.on_nonfinite
        return d

    @staticmethod
    def from_dict(d: Any) -> PlanningOptions:
        """The options of a plan file's ``planned_with`` (``zero_stage`` -1, as earlier
        versions wrote ``auto``, reads as ``auto``; their ``interleaved`` as ``interleave``).

        Raises:
            ValidationError: not an object, or a field of the wrong type or value.
        """
        require(isinstance(d, dict), f"planned_with must be an object, got {type(d).__name__}")
        w = d.get("tensor_widths")
        require(w is None or isinstance(w, list),
                f"planned_with: tensor_widths must be a list or null, got {w!r}")  # fmt: skip
        return PlanningOptions(
            planner=d.get("planner", "dapple"),
            zero_stage=_zero_read(d.get("zero_stage", 0)),
            tensor_widths=None if w is None else tuple(w),
            interleave=d.get("interleave", d.get(_OLD_INTERLEAVE, False)),
            schedule=d.get("schedule"),
            virtual_stages=d.get("virtual_stages", 1),
            on_nonfinite=d.get("on_nonfinite", "stop"),
        )


def _zero_read(value: Any) -> Any:
    """``planned_with.zero_stage`` of a plan file: ``auto`` for the -1 of earlier versions,
    else ``value`` as it is (checked by :class:`PlanningOptions`)."""
    is_old_auto = isinstance(value, int) and not isinstance(value, bool) and value == _OLD_AUTO
    return "auto" if is_old_auto else value
