"""The planner registry: every planner by name, with what it is (like the schedules'
:mod:`dapple.schedule.registry`).

:func:`dapple.planner.make_plan`, :class:`~dapple.planner.plan_config.PlanConfig`, ``dapple plan
--planner`` and ``--compare``, and the code that treats the DAPPLE search's plans apart from
a baseline's ask :func:`get_planner` (or :func:`searched`) instead of comparing names. Built
in, in this order: ``dapple`` (the DAPPLE search, :func:`~dapple.planner.search.dapple_search`),
the baselines ``dp``, ``straight``, ``gpipe`` and ``pipedream``
(:mod:`~dapple.planner.baselines`), the ``exhaustive`` oracle (:mod:`~dapple.planner.oracle`)
and the torchtitan-style ``grid`` (:mod:`~dapple.planner.grid`).

Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.planner.baselines import dp_plan, gpipe_plan, pipedream_plan, straight_plan_baseline
from dapple.planner.grid import grid_plan
from dapple.planner.oracle import exhaustive_plan

__all__ = [
    "DEFAULT_PLANNER",
    "PLANNERS",
    "BaselineRule",
    "PlannerSpec",
    "get_planner",
    "planner_names",
    "searched",
]

BaselineRule = Callable[[ModelProfile, Cluster, int], Plan]
"""A baseline's plan of a profile on a cluster for a global batch size."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerSpec:
    """One planner: its name, its rule, and how the rest of dapple treats its plans."""

    name: str
    """The name ``--planner``, ``planner=`` and a plan file's ``planner`` give."""
    summary: str
    """One line on what it plans (``dapple plan --help``)."""
    rule: BaselineRule | None = None
    """A baseline's rule; None: the DAPPLE search, which :func:`~dapple.planner.make_plan` runs
    with the search options (ZeRO stage, tensor widths, interleaving, progress)."""
    schedule_base: bool = False
    """Its partition is one the per-schedule comparison (``dapple plan --compare``) starts
    from."""

    @property
    def is_search(self) -> bool:
        """The DAPPLE search: it takes the search options, and its plan is the search's answer
        (planned anew for a schedule with its own cut), where a baseline's is the partition its
        rule fixes (refused when a schedule cannot run it)."""
        return self.rule is None


DEFAULT_PLANNER = "dapple"
"""The planner used when none is named."""

PLANNERS: dict[str, PlannerSpec] = {
    s.name: s
    for s in (
        PlannerSpec(name=DEFAULT_PLANNER, summary="the DAPPLE search (paper section 5)",
                    schedule_base=True),
        PlannerSpec(name="dp", summary="pure data parallelism", rule=dp_plan),
        PlannerSpec(name="straight", summary="one stage per device, layers balanced by time",
                    rule=straight_plan_baseline, schedule_base=True),
        PlannerSpec(name="gpipe", summary="GPipe's partition, re-computing every stage",
                    rule=gpipe_plan),
        PlannerSpec(name="pipedream", summary="PipeDream's partition and replication, run "
                    "synchronously", rule=pipedream_plan),
        PlannerSpec(name="exhaustive", summary="the least L over every policy and placement "
                    "(small instances)", rule=exhaustive_plan),
        PlannerSpec(name="grid", summary="the best dp x tp x pp grid point (torchtitan-style)",
                    rule=grid_plan),
    )
}  # fmt: skip
"""Every planner by name, in the order ``dapple plan --compare`` lists them."""


def get_planner(name: str) -> PlannerSpec:
    """The planner called ``name``.

    Raises:
        ValidationError: no such planner (naming every one).
    """
    spec = PLANNERS.get(name)
    if spec is None:
        raise ValidationError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")
    return spec


def planner_names() -> tuple[str, ...]:
    """Every planner's name, in the registry's order."""
    return tuple(PLANNERS)


def searched(plan: Plan) -> bool:
    """``plan`` is the DAPPLE search's answer: made by a searching planner (not a baseline, nor
    by hand), as its ``planner`` and the options it was made with
    (:attr:`~dapple.core.plan.Plan.planned_with`) say."""
    names = [plan.planner, *(() if plan.planned_with is None else (plan.planned_with.planner,))]
    return all(n in PLANNERS and PLANNERS[n].is_search for n in names)
