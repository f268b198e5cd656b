"""The planner registry: names, rules and roles in one table, and no planner-name comparisons
elsewhere (:mod:`dapple.planner.registry`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from builders import make_cluster, make_profile
from dapple.core.plan import straight_plan
from dapple.core.planning_options import PlanningOptions
from dapple.errors import ValidationError
from dapple.planner import make_plan
from dapple.planner.plan_config import PlanConfig
from dapple.planner.registry import (
    PLANNERS,
    get_planner,
    planner_names,
    searched,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "dapple"


def test_the_registry_lists_every_planner_in_order() -> None:
    assert planner_names() == ("dapple", "dp", "straight", "gpipe", "pipedream", "exhaustive",
                               "grid")  # fmt: skip
    assert [n for n, s in PLANNERS.items() if s.is_search] == ["dapple"]
    assert [n for n, s in PLANNERS.items() if s.schedule_base] == ["dapple", "straight"]
    assert all(s.summary and s.name == n for n, s in PLANNERS.items())


def test_an_unknown_planner_is_refused_naming_every_one() -> None:
    for ask in (lambda: get_planner("best"), lambda: PlanConfig(planner="best"),
                lambda: make_plan(make_profile(4), make_cluster(), 8, "best")):  # fmt: skip
        with pytest.raises(
            ValidationError, match="unknown planner 'best'; choose one of dapple, dp"
        ):
            ask()


def test_make_plan_runs_a_baselines_rule_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    prof, cl = make_profile(4), make_cluster()
    marked = dataclasses.replace(make_plan(prof, cl, 8, "dp"), predicted_step_ms=123.0)
    monkeypatch.setitem(PLANNERS, "dp", dataclasses.replace(PLANNERS["dp"], rule=lambda *_: marked))
    got = make_plan(prof, cl, 8, "dp")
    assert got.predicted_step_ms == 123.0 and got.planned_with == PlanningOptions(planner="dp")


def test_searched_tells_the_searchs_plans_from_a_baselines_and_a_hand_made_one() -> None:
    prof, cl = make_profile(4), make_cluster()
    assert searched(make_plan(prof, cl, 8))
    assert not searched(make_plan(prof, cl, 8, "straight"))
    hand = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2)
    assert not searched(hand)  # planner "straight" by hand, no recorded options
    assert searched(dataclasses.replace(hand, planner="dapple"))
    relabelled = dataclasses.replace(make_plan(prof, cl, 8, "dp"), planner="dapple")
    assert not searched(relabelled)  # its recorded options name the planner that made it


_NAMES = "dapple|dp|straight|gpipe|pipedream|exhaustive|grid"
_COMPARISON = re.compile(
    rf"""planner\s*(==|!=)\s*["']({_NAMES})["']"""  # planner == "dp", plan.planner != "dapple"
    r"""|\bname\s*(==|!=)\s*["'](dp|straight|gpipe|pipedream|exhaustive|grid)["']"""
    r"""|\bname\s+(not\s+)?in\s+\(\s*["'](dapple|dp|straight)["']"""
)
"""A planner's name compared (``dapple`` alone is also a schedule's: only as a planner)."""


def test_no_planner_name_is_compared_outside_the_registry() -> None:
    found = [
        f"{p.relative_to(SRC)}:{i}: {line.strip()}"
        for p in sorted(SRC.rglob("*.py"))
        if p.name != "registry.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if _COMPARISON.search(line)
    ]
    assert found == []
