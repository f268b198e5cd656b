"""The Python API's planning side: plan a profiled model on a cluster.

:func:`plan` (``dapple plan``), re-exported by :mod:`dapple.api`; planning for this machine's
CPU cores is :mod:`dapple.api.planning_local`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dapple.api._inputs import PlanInputs, plan_inputs
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.planning_options import ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError, renamed_keywords
from dapple.schedule.registry import check_virtual_stages

if TYPE_CHECKING:
    from dapple.planner.plan_config import PlanConfig
    from dapple.planner.search import Progress

__all__ = ["plan", "plan_again"]


@overload
def plan(
    profile: PlanConfig, *, inputs: PlanInputs | None = None, progress: Progress | None = None
) -> Plan: ...
@overload
def plan(
    profile: ModelProfile | str | Path,
    cluster: Cluster | str,
    global_batch_size: int | None = None,
    planner: str = "dapple",
    *,
    servers: int | None = None,
    output: str | Path | None = None,
    schedule: str | None = None,
    virtual_stages: int = 1,
    mean_seq_len: float | None = None,
    max_seq_len: float | None = None,
    zero_stage: ZeroChoice = 0,
    tensor_widths: str | Sequence[int] = "auto",
    interleave: bool = False,
    on_nonfinite: str = "stop",
) -> Plan: ...
@renamed_keywords(seq_len="mean_seq_len")
def plan(
    profile: PlanConfig | ModelProfile | str | Path,
    cluster: Cluster | str | None = None,
    global_batch_size: int | None = None,
    planner: str = "dapple",
    *,
    servers: int | None = None,
    output: str | Path | None = None,
    schedule: str | None = None,
    virtual_stages: int = 1,
    mean_seq_len: float | None = None,
    max_seq_len: float | None = None,
    zero_stage: ZeroChoice = 0,
    tensor_widths: str | Sequence[int] = "auto",
    interleave: bool = False,
    on_nonfinite: str = "stop",
    inputs: PlanInputs | None = None,
    progress: Progress | None = None,
) -> Plan:
    """Plan a profiled model on a cluster (``dapple plan``): ``plan(cfg)`` the plan a
    :class:`~dapple.planner.plan_config.PlanConfig` asks for (``dapple plan``'s flags and a config
    file's ``[planning]`` section read into it), ``plan(profile, cluster, ...)`` the one its
    keyword arguments ask for - the same options, with the same names and defaults.

    Args:
        profile: A :class:`~dapple.planner.plan_config.PlanConfig` (then only ``inputs`` and
            ``progress`` go beside it), or a :class:`ModelProfile`, its JSON path, or
            ``paper:NAME`` for a shipped paper profile
            (:data:`dapple.profiler.paper_models.PAPER_MODELS`).
        cluster: A :class:`Cluster`, a preset name (``local-cpu``, ``paper-a``...) or a file.
        global_batch_size: Samples per optimizer step (None: the paper's, for a ``paper:NAME``
            profile).
        planner: ``dapple`` or a baseline (see :data:`dapple.planner.registry.PLANNERS`).
        servers: Another number of servers than the cluster's.
        output: Also save the plan JSON here.
        schedule: Run the planned stages under ``gpipe``, ``dapple``, ``interleaved`` or
            ``zbh1`` instead of the planner's choice (``dapple plan --schedule``); the
            predicted step is that schedule's
            (:func:`dapple.cost.schedule_step.schedule_latency`). ``best``: the fastest
            simulated plan over every schedule and M that fits the memory
            (:func:`dapple.planner.schedule_choice.best_schedule`).
        virtual_stages: v, model chunks per device group with ``schedule="interleaved"``.
        mean_seq_len: Mean tokens per sample to plan the step time for, from a profile
            measured at several lengths (``profile(seq_lens=...)``; ``dapple plan
            --mean-seq-len MEAN,MAX``).
        max_seq_len: Longest sample in tokens, which the memory is planned for (default
            ``mean_seq_len``).
        zero_stage: 1: replicated stages shard their optimizer state (ZeRO-1); 2: their
            gradients too (ZeRO-2); 3: their parameters too (ZeRO-3, gathered once per step or
            per micro-batch); ``"auto"``: per stage, where memory asks for it (dapple planner
            only; the plan records each stage's, which :func:`train` follows).
        tensor_widths: The tensor widths t to search (each of 1, 2, 4, 8, dividing the server
            size; dapple planner only), or ``"auto"``: 1, and every width that fits when some
            layer of the profile shards (``LayerProfile.tensor_parallel``).
        interleave: Also search interleaved 1F1B (v = 2 chunks per device group): the dapple
            planner's own plans interleaved and the grid's interleaved points
            (:mod:`dapple.planner.interleaving`); the plan may then have
            ``schedule == "interleaved"``, its ``predicted_step_ms`` that schedule's step rule
            (``dapple plan --interleave``; dapple planner only, not with ``schedule``).
        on_nonfinite: The run's non-finite mode (``dapple train --on-nonfinite``), whose step
            point a ``schedule`` is simulated and predicted with (``off``: no step collective,
            consecutive steps overlap).
        inputs: With a ``PlanConfig``: what it names, already loaded (``dapple plan`` loads
            them naming its flags); None: loaded here (:func:`~dapple.api.plan_inputs`).
        progress: With a ``PlanConfig``: ``progress(done, total)`` of the DAPPLE search.

    Raises:
        ValidationError: Unknown planner or schedule, bad batch size, bad files, lengths
            without a profile measured at several, v not dividing a device group's layers,
            tensor widths that cannot be searched (t > 1 for a profile where no layer shards),
            ``interleave`` with a ``schedule``, a baseline planner or a cluster with host terms;
            with a ``PlanConfig``, any keyword option beside it.
        InfeasibleError: No plan fits the devices' memory.
    """
    from dapple.planner.plan_config import PlanConfig, check_interleave

    if isinstance(profile, PlanConfig):
        _only_config(locals())
        check_interleave(profile.interleave, profile.schedule)
        return _plan(profile, inputs or plan_inputs(profile), progress)
    if inputs is not None or progress is not None or cluster is None:
        raise ValidationError(
            "plan(profile, cluster, ...) needs a cluster and takes no inputs or progress (those "
            "go with a PlanConfig: plan(cfg, inputs=..., progress=...))"
        )
    widths = tensor_widths if isinstance(tensor_widths, str) else tuple(tensor_widths)
    cfg = PlanConfig(
        profile=_name(profile), cluster=_name(cluster), servers=servers,
        global_batch_size=global_batch_size, planner=planner, mean_seq_len=mean_seq_len,
        max_seq_len=max_seq_len, schedule=schedule, virtual_stages=virtual_stages,
        zero_stage=zero_stage, tensor_widths=widths, interleave=interleave,
        on_nonfinite=on_nonfinite, output=None if output is None else str(output),
    )  # fmt: skip
    check_interleave(interleave, schedule)
    return _plan(cfg, plan_inputs(cfg, profile, cluster), None)


def _only_config(given: dict[str, Any]) -> None:
    """``plan(cfg)`` takes the planning options from ``cfg``: none of the keyword form's beside
    it.

    Raises:
        ValidationError: naming those given.
    """
    import inspect

    params = inspect.signature(plan).parameters
    own = ("profile", "inputs", "progress")
    extra = [n for n, p in params.items() if n not in own and given[n] != p.default]
    if extra:
        raise ValidationError(
            f"plan(cfg) takes the planning options from cfg, got also {', '.join(extra)}"
        )


def _name(x: ModelProfile | Cluster | str | Path) -> str | None:
    """A profile or cluster given by name or path, as the config holds it (None: an object)."""
    return None if isinstance(x, (ModelProfile, Cluster)) else str(x)


def _plan(cfg: PlanConfig, inputs: PlanInputs, progress: Progress | None) -> Plan:
    """The plan ``cfg`` asks for on its loaded ``inputs``: the planner's search, then the
    schedule asked for, recording ``cfg``'s options (:func:`~dapple.planner.plan_config.
    options_of`); saved to ``cfg.output`` when given, which is checked before the search."""
    from dapple.files.output_path import check_output_file
    from dapple.planner import make_plan
    from dapple.planner.plan_config import options_of, tensor_width_list

    if cfg.output is not None:
        check_output_file(cfg.output, "output plan file")
    prof, cl = inputs.profile, inputs.cluster
    if cfg.schedule not in (None, "best"):
        from dapple.planner.schedule_choice import check_v_layers

        check_v_layers(cfg.schedule, prof, cl)  # a V's layers, before the search
    result = make_plan(
        prof,
        cl,
        inputs.global_batch_size,
        cfg.planner,
        progress=progress,
        zero_stage=cfg.zero_stage,
        tensor_widths=tensor_width_list(cfg.tensor_widths),
        interleave=cfg.interleave,
    )
    result = _under_schedule(result, prof, cl, cfg)
    result = dataclasses.replace(result, planned_with=options_of(cfg))
    if cfg.output is not None:
        result.save(cfg.output)
    return result


def plan_again(cfg: PlanConfig, profile: ModelProfile, cluster: Cluster) -> Plan:
    """The plan ``cfg`` asks for on ``profile`` (already at ``cfg``'s lengths) and ``cluster``,
    made as :func:`plan` makes it: an elastic run's re-plan for the devices left
    (:attr:`dapple.runtime.launch.elastic.ElasticPolicy.plan_again`), ``cfg`` the options the
    first plan recorded (:func:`~dapple.planner.plan_config.config_of`).

    Raises:
        ValidationError: ``cfg`` names no global batch size, or the plan cannot be put under
            the schedule ``cfg`` asks for.
        InfeasibleError: no plan fits.
    """
    if cfg.global_batch_size is None:
        raise ValidationError("a re-plan needs the first plan's global_batch_size, got None")
    return _plan(cfg, PlanInputs(profile, cluster, cfg.global_batch_size), None)


def _under_schedule(result: Plan, prof: ModelProfile, cl: Cluster, cfg: PlanConfig) -> Plan:
    """The planned stages under ``cfg.schedule``, its step predicted with the step point of
    ``cfg.on_nonfinite``; a schedule with its own cut (a V) that the DAPPLE planner's plan
    cannot hold (a group of one layer): its best plan on balanced pipelines
    (:func:`~dapple.planner.schedule_choice.best_under_schedule`)."""
    schedule, mode = cfg.schedule, cfg.on_nonfinite
    if schedule == "best":
        from dapple.planner.schedule_choice import best_schedule

        chosen = best_schedule(result, prof, cl, on_nonfinite=mode)[0].plan
        assert chosen is not None
        return chosen
    if schedule is not None:
        from dapple.planner.schedule_choice import under_schedule

        return under_schedule(result, schedule, cfg.virtual_stages, prof, cl, on_nonfinite=mode)
    check_virtual_stages(cfg.virtual_stages, None)
    return result
