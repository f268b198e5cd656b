"""The Python API's running side: train a plan.

:func:`train` (``dapple train``), re-exported by :mod:`dapple.api`. Training checks the plan
against the model before any worker starts.

A run's configuration goes one way, down: ``dapple train`` reads its flags and ``--config``
file once into a :class:`~dapple.api.run_config.RunConfig` (:mod:`dapple.cli._train_flags`),
checks where it will write, starts the workers and hands the config to :func:`train`. Here the
plan, model and data it names are loaded (:func:`~dapple.api.run_inputs`), the config is
checked against them (:mod:`dapple.api._checks`: the plan, the data, the checkpoints, the
profile), its step time and memory are predicted
(:mod:`dapple.api.predicting`), and it is resolved into the runtime's
:class:`~dapple.runtime.train_config.TrainConfig`
(:func:`~dapple.api.run_config.resolve_train_config`), which :func:`dapple.runtime.train` gets
whole. What ``dapple train`` prints after the run it reads from the metrics returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dapple.api._checks import (
    check_before_run,
    check_host,
    check_outputs,
    check_run,
    dataset,
    seq_overrides,
)
from dapple.api._inputs import (
    RunInputs,
    WorkloadLike,
    as_cluster,
    as_profile,
    as_workload,
    plan_with,
    run_inputs,
    with_profile_set,
)
from dapple.api.predicting import RunPrediction, predict_run
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.workload import Workload

if TYPE_CHECKING:
    from dapple.api.run_config import RunConfig, RunOptions
    from dapple.models.fingerprint import Fingerprint
    from dapple.runtime import StepMetrics
    from dapple.runtime.launch.early import EarlyWorkers

__all__ = ["PLANNED_MEMORY", "train"]

PLANNED_MEMORY = "planned_memory_bytes"
"""The key of the last step's ``extra`` that holds the planner's per-replica memory estimate of
each device group (:func:`~dapple.api.predicting.planned_memory`), for a run with a profile and
cluster."""


@overload
def train(
    plan: RunConfig,
    *,
    inputs: RunInputs | None = None,
    early: EarlyWorkers | None = None,
    flags: bool = False,
) -> list[StepMetrics]: ...
@overload
def train(
    plan: Plan | str | Path,
    workload: WorkloadLike,
    steps: int = 1,
    *,
    overrides: Mapping[str, Any] | None = None,
    data: Any = None,
    eval_data: Any = None,
    seq_len: int | None = None,
    documents: str | None = None,
    schedule: str | None = None,
    policy: str | None = None,
    virtual_stages: int = 1,
    keep: int | None = 3,
    eval_batches: int | None = None,
    require_resume: bool = False,
    profile: ModelProfile | str | Path | None = None,
    cluster: Cluster | str | None = None,
    elastic: bool = False,
    min_devices: int = 1,
    max_restarts: int = 3,
    early: EarlyWorkers | None = None,
    **options: Any,
) -> list[StepMetrics]: ...
def train(
    plan: RunConfig | Plan | str | Path,
    workload: WorkloadLike | None = None,
    steps: int = 1,
    *,
    overrides: Mapping[str, Any] | None = None,
    data: Any = None,
    eval_data: Any = None,
    seq_len: int | None = None,
    documents: str | None = None,
    schedule: str | None = None,
    policy: str | None = None,
    virtual_stages: int = 1,
    keep: int | None = 3,
    eval_batches: int | None = None,
    require_resume: bool = False,
    profile: ModelProfile | str | Path | None = None,
    cluster: Cluster | str | None = None,
    elastic: bool = False,
    min_devices: int = 1,
    max_restarts: int = 3,
    inputs: RunInputs | None = None,
    early: EarlyWorkers | None = None,
    flags: bool = False,
    **options: Any,
) -> list[StepMetrics]:
    """Train a plan for ``steps`` synchronous steps (``dapple train``): ``train(cfg)`` runs a
    :class:`~dapple.api.run_config.RunConfig` (a run file's,
    :func:`~dapple.api.run_config.load_run_config`), ``train(plan, workload, ...)`` the
    run its keyword arguments ask for - the same options, with the same names and defaults.

    Args:
        plan: A :class:`~dapple.api.run_config.RunConfig` (then only ``inputs`` and
            ``early`` go beside it), or a :class:`Plan` or its JSON path.
        workload: A :class:`Workload` or a spec string.
        steps: Optimizer steps.
        overrides: Factory keyword arguments when ``workload`` is a spec (with ``split_at``,
            ``weights``, ``dynamic_dims``: ``--split-at``, ``--weights``, ``--dynamic-dims``).
        data: Training samples: a map-style dataset of ``(inputs, targets)`` or the path of a
            token file (:class:`~dapple.datasets.TokenFile`, read with ``seq_len``); None: the
            workload's synthetic batches.
        eval_data: Evaluation samples, a dataset or a token file path; without ``eval_every``
            evaluated after the last step.
        seq_len: Tokens per sample of token files; a spec-string workload is also built
            with ``seq=seq_len``.
        documents: ``pack`` or ``pad``: the paths hold documents, packed into samples or one
            per sample padded per batch (:func:`dapple.datasets.open_documents`).
        schedule, policy, virtual_stages: As in :func:`~dapple.api.verify`.
        keep, eval_batches, require_resume, profile, cluster, elastic, min_devices,
            max_restarts: As :class:`~dapple.api.run_config.RunOptions` (``keep=None``: every
            checkpoint; ``profile`` and ``cluster`` may be objects; ``elastic``: the metrics
            hold every attempt's steps, :mod:`dapple.runtime.launch.elastic`).
        inputs: With a ``RunConfig``: what it names, already loaded; None: loaded here
            (:func:`~dapple.api.run_inputs`; with ``echo``, saying so).
        early, flags: ``dapple train``'s own call: the workers it started first; the
            checks' messages name its flags.
        **options: The other :class:`dapple.runtime.TrainConfig` fields (``seed``,
            ``optimizer``, ``lr``, ``weight_decay``, ``zero_stage``, ``device``,
            ``metrics_path``, ``checkpoint_dir``, ``save_every``, ``resume``, ``eval_every``,
            ``precision``, ``echo``...).

    Returns:
        Rank 0's metrics of every step. With ``profile`` and ``cluster`` each carries the
        simulated step time (``predicted_step_ms``), and the last one's ``extra`` the planner's
        memory estimate per device group under :data:`PLANNED_MEMORY`
        (:func:`~dapple.api.predicting.predict_run`).

    Raises:
        ValidationError: Bad plan, workload or options; an output rank 0 could not write,
            before anything is loaded (:func:`~dapple.api._checks.check_outputs`); a plan made
            for another model (:meth:`~dapple.core.plan.Plan.check_model`); a ``profile`` of
            another model (:func:`~dapple.models.fingerprint.check_profile_model`); a stage of
            width t_s > 1 the model cannot be cut over (:mod:`dapple.runtime.parallel.tensor_check`).
        CheckpointError: A refusal of :func:`~dapple.api._checks.check_long_run` (nothing to
            resume under ``require_resume``, checkpoints without ``resume``, another model's).
        RankFailure: A worker failed.
    """
    from dapple.api.run_config import RunConfig, RunOptions
    from dapple.runtime.train_config import TrainConfig

    if isinstance(plan, RunConfig):
        _only_config(locals(), options)
        check_outputs(plan.train, flags=flags)
        given = _named(inputs or run_inputs(plan, cli=flags, echo=plan.train.echo), plan.run)
        _check_inputs(given)
        return _launch(plan, given, early, flags)
    workload = _keyword_workload(workload, inputs)
    train_cfg = check_outputs(TrainConfig(steps=steps, **options), flags=flags)
    run = RunOptions(keep=keep or 0, eval_batches=eval_batches, require_resume=require_resume,
                     elastic=elastic, min_devices=min_devices, max_restarts=max_restarts,
                     profile=_name(profile), cluster=_name(cluster))  # fmt: skip
    given = RunInputs(plan_with(plan, schedule, policy, virtual_stages),
                      as_workload(workload, seq_overrides(workload, overrides, seq_len)),
                      profile=profile, cluster=cluster)  # fmt: skip
    _check_inputs(given)
    given = dataclasses.replace(given, data=dataset(data, seq_len, documents),
                                eval_data=dataset(eval_data, seq_len, documents))  # fmt: skip
    cfg = RunConfig(train=train_cfg, run=run)
    return _launch(cfg, given, early, flags)


def _keyword_workload(workload: WorkloadLike | None, inputs: RunInputs | None) -> WorkloadLike:
    """The workload of ``train(plan, workload, ...)``, which has one and no loaded inputs.

    Raises:
        ValidationError: saying what the keyword form needs.
    """
    if workload is None or inputs is not None:
        raise ValidationError(
            "train(plan, workload, ...) needs a workload and takes no inputs (those go with a "
            "RunConfig: train(cfg, inputs=...))"
        )
    return workload


def _only_config(given: dict[str, Any], options: dict[str, Any]) -> None:
    """``train(cfg)`` takes the run's options from ``cfg``: none of the keyword form's beside it.

    Raises:
        ValidationError: naming those given.
    """
    import inspect

    params = inspect.signature(train).parameters
    own = ("plan", "inputs", "early", "flags", "options")
    extra = [n for n, p in params.items() if n not in own and given[n] != p.default]
    extra += sorted(options)
    if extra:
        raise ValidationError(
            f"train(cfg) takes the run's options from cfg, got also {', '.join(extra)}"
        )


def _named(inputs: RunInputs, run: RunOptions) -> RunInputs:
    """``inputs`` with ``run``'s profile and cluster names where it holds no object."""
    return dataclasses.replace(
        inputs,
        profile=run.profile if inputs.profile is None else inputs.profile,
        cluster=run.cluster if inputs.cluster is None else inputs.cluster,
    )


def _check_inputs(inputs: RunInputs) -> None:
    """The plan was made for this model and can cut it, the profile was measured on it
    (each before any compute)."""
    from dapple.models.fingerprint import check_plan_model, fingerprint_once

    plan, wl, profile, cluster = inputs.plan, inputs.workload, inputs.profile, inputs.cluster
    check_run(plan, wl, None if cluster is None else as_cluster(cluster, None))
    fingerprint = fingerprint_once(wl)  # built once, when a check needs it
    check_plan_model(plan.model_fingerprint, wl, fingerprint)
    if profile is not None:  # measured on this model (its layers' tensors), the plan's own
        _check_profile(profile, plan, wl, fingerprint)


def _launch(
    cfg: RunConfig, inputs: RunInputs, early: EarlyWorkers | None, flags: bool
) -> list[StepMetrics]:
    """Train ``cfg`` on its checked ``inputs``: the run's checks
    (:func:`~dapple.api._checks.check_before_run`; ``flags``: naming ``dapple train``'s),
    the options resolved (:func:`~dapple.api.run_config.resolve_train_config`), checked, and
    handed to :func:`dapple.runtime.train`."""
    from dapple.api.planning import plan_again
    from dapple.api.run_config import resolve_train_config
    from dapple.runtime import train as _train
    from dapple.runtime.launch.elastic import ElasticPolicy
    from dapple.runtime.parallel.stage_mesh import check_mesh_run

    cfg = check_before_run(cfg, inputs, flags=flags)
    run, run_plan, wl = cfg.run, inputs.plan, inputs.workload
    profile, cluster = inputs.profile, inputs.cluster
    n_eval = None if inputs.eval_data is None else len(inputs.eval_data)
    tc = resolve_train_config(cfg.train, run, n_eval, run_plan.global_batch_size)
    check_mesh_run(run_plan, wl, tc)  # what stages of t_s > 1 or ZeRO-3 cannot run yet
    check_host(wl, tc.device, tc.optimizer, tc.momentum, "training")
    predicted: RunPrediction | None = None
    if profile is not None and cluster is not None:
        predicted = predict_run(run_plan, profile, cluster, tc)
        tc = dataclasses.replace(tc, predicted_step_ms=predicted.step_ms)
    replan: ElasticPolicy | None = None
    if run.elastic and profile is not None and cluster is not None:
        prof, cl = with_profile_set(profile, as_cluster(cluster))  # a profile per kind, if given
        replan = ElasticPolicy(prof, cl, min_devices=run.min_devices,
                               max_restarts=run.max_restarts, zero_stage=tc.zero_stage,
                               plan_again=plan_again)  # fmt: skip
    metrics = _train(run_plan, wl, tc, data=inputs.data, eval_data=inputs.eval_data,
                     early=early, elastic=replan)  # fmt: skip
    if predicted is None or not metrics:
        return metrics
    last = metrics[-1]
    planned = {PLANNED_MEMORY: list(predicted.memory_bytes)}
    return [*metrics[:-1], dataclasses.replace(last, extra={**last.extra, **planned})]


def _check_profile(
    profile: ModelProfile | str | Path, plan: Plan, wl: Workload, fingerprint: Fingerprint
) -> None:
    """``profile`` was measured on ``wl`` (:func:`dapple.models.fingerprint.check_profile_model`)
    and is of the model ``plan`` was made for (:meth:`~dapple.core.plan.Plan.check_fingerprint`:
    an analytic profile's shapes against the analytic profile's the plan was made from)."""
    from dapple.models.fingerprint import check_profile_model

    named = f"of {_name(profile)!r}" if isinstance(profile, ModelProfile) else repr(_name(profile))
    prof = as_profile(profile)
    check_profile_model(prof, wl, f"the profile {named}", fingerprint)
    plan.check_fingerprint(prof.model_fingerprint, f"the profile {named}")


def _name(x: ModelProfile | Cluster | str | Path | None) -> str | None:
    """How an option given as an object or a path reads in messages."""
    if isinstance(x, ModelProfile):
        return x.model_name
    return x.name if isinstance(x, Cluster) else None if x is None else str(x)
