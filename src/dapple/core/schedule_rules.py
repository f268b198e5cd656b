"""The schedule rules a :class:`~dapple.core.plan.Plan` asks for, installed from above.

Pure data model, no torch. A plan names its schedule, but the schedule registry
(:mod:`dapple.schedule.registry`) sits above ``core`` and cannot be imported from it; the
registry installs its answers here with :func:`use_schedule_rules` when it is imported (``import
dapple`` does). Until then a plan's schedule is not checked, virtual stage k of P device groups
runs on group ``k mod P``, and no plan file records a schedule module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dapple.core.plan import Plan

__all__ = [
    "ScheduleRules",
    "check_schedule",
    "group_of",
    "load_schedule_module",
    "module_of",
    "use_schedule_rules",
]


class ScheduleRules(Protocol):
    """What a :class:`~dapple.core.plan.Plan` asks the schedule registry."""

    def check(self, plan: Plan) -> None:
        """Raise :class:`~dapple.errors.ValidationError` unless the plan's schedule is
        registered and takes its ``virtual_stages``."""

    def module_of(self, schedule: str) -> str:
        """The module a plan file records for ``schedule``; empty for a built-in one."""

    def group_of(self, schedule: str, k: int, P: int, v: int) -> int:
        """The device group that runs virtual stage ``k`` of ``P·v`` under ``schedule``."""

    def load(self, module: str) -> None:
        """Import a schedule module a plan file names and register its schedule."""


_schedule_rules: list[ScheduleRules] = []


def use_schedule_rules(rules: ScheduleRules) -> None:
    """Install the schedule registry's rules (:mod:`dapple.schedule.registry` does on import);
    every :class:`~dapple.core.plan.Plan` made afterwards is checked by them."""
    _schedule_rules[:] = [rules]


def check_schedule(plan: Plan) -> None:
    """Check the plan's schedule and its ``virtual_stages`` against the installed rules (no
    check without them).

    Raises:
        ValidationError: from the rules, naming the schedule.
    """
    for rules in _schedule_rules:
        rules.check(plan)


def group_of(schedule: str, k: int, P: int, v: int) -> int:
    """The device group that runs virtual stage ``k >= P`` of ``P·v`` under ``schedule``: the
    schedule's placement, or ``k mod P`` without installed rules."""
    if _schedule_rules:
        return _schedule_rules[0].group_of(schedule, k, P, v)
    return k % P


def module_of(schedule: str) -> str:
    """The module a plan file records for ``schedule``: empty for a built-in one, or without
    installed rules."""
    return _schedule_rules[0].module_of(schedule) if _schedule_rules else ""


def load_schedule_module(module: str) -> None:
    """Import the schedule module a plan file names, which registers its schedule (nothing
    without installed rules)."""
    for rules in _schedule_rules:
        rules.load(module)
