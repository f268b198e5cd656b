"""The Python API's simulation side: one typed :class:`SimulateConfig` behind ``dapple simulate``
and :func:`simulate`.

``dapple simulate``'s flags and a config file's ``[simulate]`` section (each key its field's
name; :func:`load_simulate_config`) are read once into a :class:`SimulateConfig`;
:func:`simulate_runs` simulates what it asks for (the plan under its schedule and policy, and
with ``other_schedule`` the schedule its own is measured against) and :func:`simulate` the
plan's own run; :func:`check_files` and :func:`write_files` check, before anything is read,
and write, after, the files it asks for (Gantt chart, memory plot, layout, trace). The keyword
form ``simulate(plan, profile, cluster, ...)`` takes objects or their files and goes down the
same path. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.planning_options import NONFINITE_MODES
from dapple.core.profile import ModelProfile
from dapple.files.config_file import Schema, dump, load

if TYPE_CHECKING:
    from dapple.simulate import SimResult

__all__ = [
    "SIMULATE_SECTIONS",
    "SimulateConfig",
    "Simulated",
    "check_files",
    "dump_simulate_config",
    "load_simulate_config",
    "simulate",
    "simulate_runs",
    "write_files",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulateConfig:
    """What ``dapple simulate`` is asked for: the plan, what it runs on, and what to write."""

    plan: str | None = None
    """The plan JSON (from ``dapple plan``; required)."""
    profile: str | None = None
    """The model profile JSON, ``paper:NAME``, or a profile per device kind ``KIND=FILE,...``
    (required)."""
    cluster: str | None = None
    """A cluster JSON/TOML file or preset (required)."""
    servers: int | None = None
    """Another number of servers than the cluster's."""
    schedule: str | None = None
    """Simulate this schedule instead of the plan's."""
    virtual_stages: int = 1
    """v, model chunks per device group with ``schedule = "interleaved"``."""
    policy: str | None = None
    """The warm-up policy (``A`` or ``B``) instead of the plan's."""
    other_schedule: bool = False
    """Also simulate the plan under the schedule its own is measured against
    (:attr:`~dapple.schedule.spec.ScheduleSpec.compare_with`) and stack both in the pictures."""
    on_nonfinite: str = "stop"
    """The run's non-finite mode (``dapple train --on-nonfinite``): ``stop`` or ``skip`` end
    every step in the guard's collective, which every rank waits for; ``off`` has none, and
    the step time is the period of consecutive steps, which overlap."""
    gantt: str | None = None
    """A Gantt chart image to write (PNG/SVG/PDF)."""
    trace: str | None = None
    """A Chrome/Perfetto trace JSON to write."""
    memory: str | None = None
    """A memory-over-time plot image to write."""
    layout: str | None = None
    """A picture of the plan's stages on the cluster to write."""


SIMULATE_SECTIONS: Schema = {
    "simulate": tuple(("", f.name) for f in dataclasses.fields(SimulateConfig))
}
"""The section of a simulation's config file and the fields its keys set."""

_OTHER_SECTIONS = (
    "model", "plan", "data", "train", "optimizer", "checkpoint", "eval", "report", "elastic",
    "planning",
)  # fmt: skip
"""The sections ``dapple train``, ``dapple profile`` and ``dapple plan`` read (a test keeps
them equal to theirs)."""


def load_simulate_config(
    path: str | Path, *, over: dict[tuple[str, str], Any] | None = None
) -> SimulateConfig:
    """The :class:`SimulateConfig` of a file's ``[simulate]`` section, with ``over`` on top
    (the other commands' sections skipped unread).

    Raises:
        ValidationError: an unreadable file, an unknown section or key, or a value of the wrong
            type (each naming the file).
    """
    return load(path, SIMULATE_SECTIONS, SimulateConfig, ignore=_OTHER_SECTIONS, over=over)


def dump_simulate_config(cfg: SimulateConfig) -> str:
    """``cfg`` as a ``[simulate]`` section that :func:`load_simulate_config` reads back."""
    return dump(cfg, SIMULATE_SECTIONS, "dapple simulate --config FILE (flags given beside it win)")


Run = tuple[str, "SimResult"]
"""A simulated plan's title and result."""


@dataclass(frozen=True, slots=True)
class Simulated:
    """What :func:`simulate_runs` simulated."""

    plan: Plan
    """The plan under the schedule and policy asked for."""
    cluster: Cluster
    """The cluster, with each kind's own profile for a profile set."""
    runs: list[Run]
    """The plan's run, and with ``other_schedule`` the other schedule's (the baseline first)."""
    doubt: str | None = None
    """Why the profile cannot be checked to be of the plan's model (None: it can, or the plan
    records nothing to check it with; :meth:`~dapple.core.plan.Plan.profile_doubt`)."""


def simulate_runs(
    cfg: SimulateConfig,
    *,
    plan: Plan | None = None,
    profile: ModelProfile | None = None,
    cluster: Cluster | None = None,
    flags: bool = False,
) -> Simulated:
    """Simulate what ``cfg`` asks for (``dapple simulate``), on the objects given beside it in
    place of the files it names; ``flags``: messages name ``dapple simulate``'s flags.

    Raises:
        ValidationError: bad servers, files or schedule; the plan does not fit the profile or
            cluster, or the profile is of another model than the plan's
            (:meth:`~dapple.core.plan.Plan.check_fingerprint`); the schedule does not fit the
            plan (v not dividing a device group's layers, M not a multiple of the groups).
    """
    from dapple.api._inputs import as_cluster, plan_with, with_profile_set
    from dapple.core.plan_checks import check_expert_widths
    from dapple.errors import ValidationError
    from dapple.simulate import simulate as _simulate
    from dapple.simulate.plan_variants import baseline_first, compared_plan

    if cfg.servers is not None and cfg.servers < 1:  # before the plan and profile are read
        raise ValidationError(f"--servers must be >= 1, got {cfg.servers}")
    if cfg.on_nonfinite not in NONFINITE_MODES:
        flag = "--on-nonfinite" if flags else "on_nonfinite"
        raise ValidationError(f"{flag} must be stop, skip or off, got {cfg.on_nonfinite!r}")
    plan_in = plan if plan is not None else cfg.plan
    profile_in = profile if profile is not None else cfg.profile
    cluster_in = cluster if cluster is not None else cfg.cluster
    if plan_in is None or profile_in is None or cluster_in is None:
        raise ValidationError("a simulation needs a plan, a profile and a cluster")
    base = plan_in if isinstance(plan_in, Plan) else Plan.load(plan_in)
    prof, cl = with_profile_set(
        profile_in, as_cluster(cluster_in, cfg.servers)
    )  # a profile per kind, if given
    named = f"of {prof.model_name!r}" if profile is not None else repr(cfg.profile)
    label = f"--profile {cfg.profile!r}" if flags else f"the profile {named}"
    base.check_fingerprint(prof.model_fingerprint, label)
    doubt = base.profile_doubt(prof.model_name, prof.model_fingerprint)
    p = plan_with(base, cfg.schedule, cfg.policy, cfg.virtual_stages, cli=flags)
    if p.num_layers == prof.num_layers:  # another count is the simulator's refusal
        check_expert_widths(p, prof, label)
    mode = cfg.on_nonfinite
    runs: list[Run] = [(_title(p), _simulate(p, prof, cl, on_nonfinite=mode))]
    if cfg.other_schedule:
        other = compared_plan(p)
        runs = baseline_first(
            [*runs, (_title(other), _simulate(other, prof, cl, on_nonfinite=mode))]
        )
    return Simulated(p, cl, runs, doubt)


def check_files(cfg: SimulateConfig, *, flags: bool = False) -> None:
    """Every file ``cfg`` asks for can be written, and each picture has a known format
    (:mod:`dapple.files.output_path`), before anything is read or simulated; ``flags``:
    messages name ``dapple simulate``'s flags.

    Raises:
        ValidationError: naming the option and the path.
    """
    from dapple.files.output_path import check_output_file, check_picture_file

    for opt in ("gantt", "memory", "layout", "trace"):
        path = getattr(cfg, opt)
        if path is not None:
            check = check_output_file if opt == "trace" else check_picture_file
            check(path, f"--{opt} file" if flags else f"{opt} file")


def write_files(cfg: SimulateConfig, done: Simulated) -> list[str]:
    """Write the files ``cfg`` asks for from the simulation ``done``: the Gantt chart and the
    memory plot of its runs, the plan's layout on the cluster, the first run's trace.

    Returns:
        The paths written, in that order.
    """
    written: list[str] = []
    if cfg.gantt or cfg.memory:
        from dapple.simulate.plots import plot_gantt, plot_memory

        if cfg.gantt:
            plot_gantt(done.runs, cfg.gantt)
            written.append(cfg.gantt)
        if cfg.memory:
            plot_memory(done.runs, cfg.memory)
            written.append(cfg.memory)
    if cfg.layout:
        from dapple.simulate.layout import plot_layout

        plot_layout(done.plan, done.cluster, cfg.layout)
        written.append(cfg.layout)
    if cfg.trace:
        from dapple.simulate.trace import write_trace

        write_trace(done.runs[0][1], cfg.trace)
        written.append(cfg.trace)
    return written


def _title(plan: Plan) -> str:
    from dapple.schedule.registry import get_schedule

    name = get_schedule(plan.schedule).title_of(plan)
    return f"{name}, {plan.replication}, M={plan.num_micro_batches}"


@overload
def simulate(plan: SimulateConfig) -> SimResult: ...
@overload
def simulate(
    plan: Plan | str | Path,
    profile: ModelProfile | str | Path,
    cluster: Cluster | str,
    *,
    schedule: str | None = None,
    policy: str | None = None,
    virtual_stages: int = 1,
    on_nonfinite: str = "stop",
) -> SimResult: ...
def simulate(
    plan: SimulateConfig | Plan | str | Path,
    profile: ModelProfile | str | Path | None = None,
    cluster: Cluster | str | None = None,
    *,
    schedule: str | None = None,
    policy: str | None = None,
    virtual_stages: int = 1,
    on_nonfinite: str = "stop",
) -> SimResult:
    """Simulate one step of a plan (``dapple simulate``): ``simulate(cfg)`` the plan a
    :class:`SimulateConfig` names, under its schedule and policy, writing the files it asks for
    (:func:`check_files` first, :func:`write_files` after), or ``simulate(plan, profile,
    cluster, ...)`` the one its arguments give, down the same path (:func:`simulate_runs`).

    Args:
        plan: A :class:`SimulateConfig` (then nothing else beside it), a :class:`Plan` or its
            JSON path.
        profile: A :class:`ModelProfile`, its JSON path, ``paper:NAME``, or ``KIND=FILE,...``.
        cluster: A :class:`Cluster`, a preset name or a file.
        schedule: A registered schedule (``gpipe``, ``dapple``, ``interleaved``, ``zbh1``...)
            instead of the plan's.
        policy: ``A`` or ``B`` instead of the plan's.
        virtual_stages: v, model chunks per device group with ``schedule="interleaved"``.
        on_nonfinite: the run's non-finite mode (:attr:`SimulateConfig.on_nonfinite`).

    Raises:
        ValidationError: see :func:`simulate_runs`; with a ``SimulateConfig``, any other
            argument beside it, or a file it asks for that cannot be written.
    """
    from dapple.errors import ValidationError

    if isinstance(plan, SimulateConfig):
        given = [n for n, v in (("profile", profile), ("cluster", cluster), ("schedule", schedule),
                                ("policy", policy)) if v is not None]  # fmt: skip
        given += ["virtual_stages"] if virtual_stages != 1 else []
        given += ["on_nonfinite"] if on_nonfinite != "stop" else []
        if given:
            extra = ", ".join(given)
            raise ValidationError(f"simulate(cfg) takes its options from cfg, got also {extra}")
        check_files(plan)
        done = simulate_runs(plan)
        write_files(plan, done)
        return done.runs[0][1]
    if profile is None or cluster is None:
        raise ValidationError("simulate(plan, profile, cluster) needs a profile and a cluster")
    cfg = SimulateConfig(
        plan=_name(plan), profile=_name(profile), cluster=_name(cluster), schedule=schedule,
        policy=policy, virtual_stages=virtual_stages, on_nonfinite=on_nonfinite,
    )  # fmt: skip
    return simulate_runs(
        cfg,
        plan=plan if isinstance(plan, Plan) else Plan.load(plan),
        profile=profile if isinstance(profile, ModelProfile) else None,
        cluster=cluster if isinstance(cluster, Cluster) else None,
    ).runs[0][1]


def _name(x: Plan | ModelProfile | Cluster | str | Path) -> str:
    """A file, preset or spec as the config holds it; an object by its name."""
    return str(x) if isinstance(x, (str, Path)) else str(getattr(x, "name", "") or "")
