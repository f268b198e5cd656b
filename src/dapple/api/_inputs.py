"""What the Python API's functions take: each input as an object, a path or a name, resolved.

A model is a :class:`~dapple.models.workload.Workload` or a spec string for
:func:`dapple.models.spec.load`; a plan, a profile and a cluster are objects or the paths
(names, for a cluster preset or a ``paper:NAME`` profile) of their JSON files. A plan given to
run or simulate may be put under another schedule and policy (:func:`plan_with`). What a run's
configuration names is loaded once into :class:`RunInputs` (:func:`run_inputs`), and what a
plan's into :class:`PlanInputs` (:func:`plan_inputs`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.spec import load
from dapple.models.workload import Workload
from dapple.schedule.registry import check_virtual_stages

if TYPE_CHECKING:
    from dapple.api.run_config import RunConfig
    from dapple.planner.plan_config import PlanConfig

__all__ = [
    "PlanInputs",
    "RunInputs",
    "WorkloadLike",
    "as_cluster",
    "as_plan",
    "as_profile",
    "as_workload",
    "global_batch_of",
    "plan_inputs",
    "plan_with",
    "run_inputs",
    "say_phase",
    "with_profile_set",
]

WorkloadLike = Workload | str
"""A :class:`Workload` or a spec string for :func:`dapple.models.spec.load`."""


@dataclass(frozen=True, slots=True)
class RunInputs:
    """What a run's configuration (:class:`~dapple.api.run_config.RunConfig`) names,
    loaded: its plan under the schedule asked for, its model, its datasets, and the profile
    and cluster as objects (None: :class:`~dapple.api.run_config.RunOptions`' names)."""

    plan: Plan
    workload: Workload
    data: Any = None
    """Training samples (None: the workload's synthetic batches)."""
    eval_data: Any = None
    """Evaluation samples (None: no evaluation data)."""
    profile: ModelProfile | str | Path | None = None
    cluster: Cluster | str | None = None


def run_inputs(cfg: RunConfig, *, cli: bool = False, echo: bool = False) -> RunInputs:
    """The plan, model and data ``cfg`` names, loaded (:class:`RunInputs`): the model's options
    and the data checked first, then the plan read, then the model built.

    Args:
        cfg: the run.
        cli: name the command-line flags in a schedule's message (:func:`plan_with`).
        echo: rank 0 says when the model starts loading (:func:`say_phase`).

    Raises:
        ValidationError: no plan or model in ``cfg``, a bad plan or model, or data options
            that do not fit together (:meth:`~dapple.api.run_config.RunConfig.model_overrides`).
    """
    from dapple.api.run_config import open_run_data

    c, d = cfg.plan, cfg.data
    if c.path is None or cfg.model.spec is None:
        raise ValidationError(
            f"a run needs a plan path and a model spec, got plan.path={c.path!r} and "
            f"model.spec={cfg.model.spec!r}"
        )
    overrides = cfg.model_overrides()  # checked before the model loads
    data, evals = (None if x is None else open_run_data(x, d.seq_len, d.documents)
                   for x in (d.path, d.eval_path))  # fmt: skip
    plan = plan_with(c.path, c.schedule, c.policy, c.virtual_stages, cli=cli)
    if echo:
        say_phase(f"start-up: loading the model {cfg.model.spec}")
    return RunInputs(plan, load(cfg.model.spec, **overrides), data, evals)


def say_phase(line: str) -> None:
    """A run's start-up phase as it starts, on rank 0's stdout as the step lines (under
    ``torchrun`` every rank runs the command; the others stay silent)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What a plan's configuration (:class:`~dapple.planner.plan_config.PlanConfig`) names, loaded."""

    profile: ModelProfile
    """The model profile, for the configuration's sample lengths when it gives them
    (:func:`~dapple.cost.at_length.profile_for_lengths`)."""
    cluster: Cluster
    """The cluster, with the configuration's number of servers."""
    global_batch_size: int
    """G: the configuration's, or the paper's for a ``paper:NAME`` profile."""


def plan_inputs(
    cfg: PlanConfig,
    profile: ModelProfile | str | Path | None = None,
    cluster: Cluster | str | None = None,
    *,
    cli: bool = False,
) -> PlanInputs:
    """The profile, cluster and G ``cfg`` names (``profile`` and ``cluster``: given as objects
    or names instead), loaded in that order.

    Raises:
        ValidationError: no profile or cluster, a bad file, lengths the profile cannot give, or
            no G for a profile that is not ``paper:NAME`` (``cli``: named as ``dapple plan``'s
            flag).
    """
    from dapple.cost.at_length import profile_for_lengths

    profile = cfg.profile if profile is None else profile
    cluster = cfg.cluster if cluster is None else cluster
    if profile is None or cluster is None:
        raise ValidationError(
            f"a plan needs a profile and a cluster, got profile={profile!r} and cluster={cluster!r}"
        )
    prof, cl = with_profile_set(profile, as_cluster(cluster, cfg.servers))
    if cfg.mean_seq_len is not None:
        prof = profile_for_lengths(prof, cfg.mean_seq_len, cfg.max_seq_len)
    if cli and cfg.global_batch_size is None and _paper_batch(profile) is None:
        raise ValidationError("--global-batch-size is required for a profile file")
    return PlanInputs(prof, cl, global_batch_of(profile, cfg.global_batch_size))


def as_workload(workload: WorkloadLike, overrides: Mapping[str, Any] | None) -> Workload:
    """``workload`` as given, or built from its spec with ``overrides``.

    Raises:
        ValidationError: overrides for a built workload, neither a workload nor a string, or a
            bad spec.
    """
    if isinstance(workload, Workload):
        if overrides:
            raise ValidationError(
                f"overrides {sorted(overrides)} apply to a spec string, not to the already "
                f"built workload {workload.name!r}"
            )
        return workload
    if not isinstance(workload, str):
        raise ValidationError(
            f"expected a Workload or a spec string, got {type(workload).__name__}"
        )
    return load(workload, **dict(overrides or {}))


def as_plan(plan: Plan | str | Path) -> Plan:
    """``plan`` as given, or loaded from its JSON file."""
    return plan if isinstance(plan, Plan) else Plan.load(plan)


def as_profile(profile: ModelProfile | str | Path) -> ModelProfile:
    """``profile`` as given, or loaded from its JSON file or ``paper:NAME``; for a profile set
    ``KIND=FILE,...`` its first kind's (the model's; :func:`with_profile_set` gives the cluster
    the kinds' own)."""
    from dapple.core.kind_profiles import parse_profile_set
    from dapple.profiler.paper_models import load_profile

    if isinstance(profile, ModelProfile):
        return profile
    kinds = parse_profile_set(profile) if isinstance(profile, str) else None
    return load_profile(profile if kinds is None else next(iter(kinds.values())))


def with_profile_set(
    profile: ModelProfile | str | Path, cluster: Cluster
) -> tuple[ModelProfile, Cluster]:
    """``profile`` loaded (:func:`as_profile`), and ``cluster``; for a profile set
    ``KIND=FILE,...`` (:func:`~dapple.core.kind_profiles.parse_profile_set`) its first
    profile, and ``cluster`` with each kind's own
    (:func:`~dapple.core.kind_profiles.with_kind_profiles`). One profile on a cluster whose
    kinds carry their own (a cluster file with them) must be of their model.

    Raises:
        ValidationError: a bad spec or file, or profiles that do not fit the cluster's kinds.
    """
    from dapple.core.device_kinds import check_same_model
    from dapple.core.kind_profiles import parse_profile_set, with_kind_profiles

    kinds = parse_profile_set(profile) if isinstance(profile, str) else None
    if kinds is None:
        one = as_profile(profile)
        own = next((k for k in cluster.kinds if k.profile is not None), None)
        if own is not None:
            assert own.profile is not None
            check_same_model(own.profile, own.name, one, "the one given")
        return one, cluster
    loaded = {k: as_profile(v) for k, v in kinds.items()}
    return next(iter(loaded.values())), with_kind_profiles(cluster, loaded)


def as_cluster(cluster: Cluster | str, servers: int | None = None) -> Cluster:
    """``cluster`` (a preset name or a file, else as given), with ``servers`` when given."""
    if isinstance(cluster, Cluster):
        return cluster if servers is None else cluster.with_servers(servers)
    return load_cluster(cluster, servers)


def global_batch_of(profile: ModelProfile | str | Path, given: int | None) -> int:
    """G as given, or the paper's for a ``paper:NAME`` profile (else a ValidationError)."""
    if given is not None:
        return given
    G = _paper_batch(profile)
    if G is None:
        raise ValidationError("global_batch_size is required for a profile that is not paper:NAME")
    return G


def _paper_batch(profile: ModelProfile | str | Path) -> int | None:
    """The paper's G for a ``paper:NAME`` profile (None: another profile)."""
    from dapple.profiler.paper_models import PAPER_GLOBAL_BATCH, paper_name

    name = paper_name(profile) if isinstance(profile, str) else None
    return None if name is None else PAPER_GLOBAL_BATCH[name]


def plan_with(
    plan: Plan | str | Path,
    schedule: str | None,
    policy: str | None,
    virtual_stages: int = 1,
    *,
    cli: bool = False,
) -> Plan:
    """``plan`` under ``schedule`` (with v chunks for ``interleaved``,
    :func:`dapple.simulate.plan_variants.with_schedule`) and ``policy``, each when given.

    Raises:
        ValidationError: an unreadable or invalid plan file, or a schedule that does not fit
            it (``cli``: ``virtual_stages`` named as ``--virtual-stages``,
            :func:`~dapple.schedule.registry.check_virtual_stages`).
    """
    from dapple.simulate.plan_variants import with_schedule

    p = as_plan(plan)
    check_virtual_stages(virtual_stages, schedule, cli=cli)
    if schedule is not None:
        return with_schedule(p, schedule, virtual_stages, policy)
    if policy is not None:
        p = dataclasses.replace(p, policy=cast(Any, policy))
    return p
