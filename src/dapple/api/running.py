"""The Python API's running side: train a plan, verify it against one process, generate text.

:func:`train`, :func:`verify`, :func:`verify_many` and :func:`generate` (``dapple train``,
``dapple verify``, ``dapple generate``), re-exported by :mod:`dapple.api`. Training and verifying
check the plan against the model before any worker starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dapple.api._inputs import (
    RunInputs,
    WorkloadLike,
    as_cluster,
    as_plan,
    as_profile,
    as_workload,
    plan_with,
    run_inputs,
)
from dapple.api.planning import simulate
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.workload import Workload

if TYPE_CHECKING:
    from dapple.models.fingerprint import Fingerprint
    from dapple.models.generate import Generated
    from dapple.runtime import StepMetrics
    from dapple.runtime.config import TrainConfig
    from dapple.runtime.launch.early import EarlyWorkers
    from dapple.runtime.run_config import RunConfig, RunOptions
    from dapple.runtime.verify import VerifyReport

__all__ = ["VERIFY_CHECKS", "generate", "train", "verify", "verify_many"]


@overload
def train(
    plan: RunConfig, *, inputs: RunInputs | None = None, early: EarlyWorkers | None = None
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
    **options: Any,
) -> list[StepMetrics]:
    """Train a plan for ``steps`` synchronous steps (``dapple train``): ``train(cfg)`` runs a
    :class:`~dapple.runtime.run_config.RunConfig` (a run file's,
    :func:`~dapple.runtime.run_config.load_run_config`), ``train(plan, workload, ...)`` the
    run its keyword arguments ask for - the same options, with the same names and defaults.

    Args:
        plan: A :class:`~dapple.runtime.run_config.RunConfig` (then only ``inputs`` and
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
        schedule, policy, virtual_stages: As in :func:`verify`.
        keep, eval_batches, require_resume, profile, cluster: As
            :class:`~dapple.runtime.run_config.RunOptions` (``keep=None``: every checkpoint);
            ``profile`` and ``cluster`` may be objects.
        elastic, min_devices, max_restarts: As :class:`~dapple.runtime.run_config.RunOptions`:
            re-plan on ``profile`` and ``cluster`` for the devices left when one is lost
            (:mod:`dapple.runtime.launch.elastic`); the metrics then hold every attempt's steps.
        inputs: With a ``RunConfig``: what it names, already loaded (``dapple train`` loads
            them for its checks); None: loaded here (:func:`~dapple.api.run_inputs`).
        early: Workers already started for this run (``dapple train`` starts them first).
        **options: The other :class:`dapple.runtime.TrainConfig` fields (``seed``,
            ``optimizer``, ``lr``, ``weight_decay``, ``zero_stage``, ``device``,
            ``metrics_path``, ``checkpoint_dir``, ``save_every``, ``resume``, ``eval_every``,
            ``precision``, ``echo``...).

    Returns:
        Rank 0's metrics of every step.

    Raises:
        ValidationError: Bad plan, workload or options; a plan made for another model
            (:meth:`~dapple.core.plan.Plan.check_model`); a ``profile`` measured on another
            model (:func:`~dapple.models.fingerprint.check_profile_model`); a stage of tensor
            width t_s > 1 the model cannot be cut over (:mod:`dapple.runtime.parallel.tensor_check`).
        CheckpointError: ``require_resume`` and no checkpoint to resume.
        RankFailure: A worker failed.
    """
    from dapple.runtime.config import TrainConfig
    from dapple.runtime.run_config import RunConfig, RunOptions

    if isinstance(plan, RunConfig):
        _only_config(locals(), options)
        given = _named(inputs or run_inputs(plan), plan.run)
        _check_inputs(given)
        return _launch(plan, given, early)
    if workload is None or inputs is not None:
        raise ValidationError(
            "train(plan, workload, ...) needs a workload and takes no inputs (those go with a "
            "RunConfig: train(cfg, inputs=...))"
        )
    run = RunOptions(keep=keep or 0, eval_batches=eval_batches, require_resume=require_resume,
                     elastic=elastic, min_devices=min_devices, max_restarts=max_restarts,
                     profile=_name(profile), cluster=_name(cluster))  # fmt: skip
    given = RunInputs(
        plan_with(plan, schedule, policy, virtual_stages),
        as_workload(workload, _seq_overrides(workload, overrides, seq_len)),
        profile=profile,
        cluster=cluster,
    )
    _check_inputs(given)
    given = dataclasses.replace(given, data=_dataset(data, seq_len, documents),
                                eval_data=_dataset(eval_data, seq_len, documents))  # fmt: skip
    cfg = RunConfig(train=TrainConfig(steps=steps, **options), run=run)
    return _launch(cfg, given, early)


def _only_config(given: dict[str, Any], options: dict[str, Any]) -> None:
    """``train(cfg)`` takes the run's options from ``cfg``: none of the keyword form's beside it.

    Raises:
        ValidationError: naming those given.
    """
    import inspect

    params = inspect.signature(train).parameters
    own = ("plan", "inputs", "early", "options")
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
    _check_run(plan, wl, None if cluster is None else as_cluster(cluster, None))
    fingerprint = fingerprint_once(wl)  # built once, when a check needs it
    check_plan_model(plan.model_fingerprint, wl, fingerprint)
    if profile is not None:  # measured on this model (its layers' tensors)
        _check_profile(profile, wl, fingerprint)


def _launch(cfg: RunConfig, inputs: RunInputs, early: EarlyWorkers | None) -> list[StepMetrics]:
    """Train ``cfg`` on its checked ``inputs``: the options resolved
    (:func:`~dapple.runtime.run_config.resolve_train_config`), checked, and handed to
    :func:`dapple.runtime.train`."""
    from dapple.runtime import train as _train
    from dapple.runtime.launch.elastic import ElasticPolicy
    from dapple.runtime.parallel.stage_mesh import check_mesh_run, zero_floored
    from dapple.runtime.run_config import check_resumable, resolve_train_config

    run, run_plan, wl = cfg.run, inputs.plan, inputs.workload
    profile, cluster = inputs.profile, inputs.cluster
    n_eval = None if inputs.eval_data is None else len(inputs.eval_data)
    tc = resolve_train_config(cfg.train, run, n_eval, run_plan.global_batch_size)
    check_mesh_run(run_plan, wl, tc)  # what stages of t_s > 1 or ZeRO-3 cannot run yet
    _check_host_memory(wl, tc.device, tc.optimizer, tc.momentum, "training")
    if profile is not None and cluster is not None:
        predicted = simulate(zero_floored(run_plan, tc.zero_stage), profile, cluster).step_ms
        tc = dataclasses.replace(tc, predicted_step_ms=predicted)
    if run.require_resume:
        check_resumable(tc.checkpoint_dir)
    replan: ElasticPolicy | None = None
    if run.elastic and profile is not None and cluster is not None:
        replan = ElasticPolicy(as_profile(profile), as_cluster(cluster),
                               min_devices=run.min_devices, max_restarts=run.max_restarts,
                               zero_stage=tc.zero_stage)  # fmt: skip
    return _train(run_plan, wl, tc, data=inputs.data, eval_data=inputs.eval_data, early=early,
                  elastic=replan)  # fmt: skip


def _check_run(plan: Plan, wl: Workload, cluster: Cluster | None = None) -> None:
    """The plan was made for this model (:meth:`~dapple.core.plan.Plan.check_model`) and its
    tensor groups can cut it (:func:`dapple.runtime.parallel.tensor_check.check_tensor_run`)."""
    from dapple.runtime.parallel.tensor_check import check_tensor_run

    plan.check_model(wl.name, wl.num_layers)
    check_tensor_run(plan, wl, cluster)


def _check_profile(
    profile: ModelProfile | str | Path, wl: Workload, fingerprint: Fingerprint
) -> None:
    """``profile`` was measured on ``wl`` (:func:`dapple.models.fingerprint.check_profile_model`)."""
    from dapple.models.fingerprint import check_profile_model

    named = f"of {_name(profile)!r}" if isinstance(profile, ModelProfile) else repr(_name(profile))
    check_profile_model(as_profile(profile), wl, f"the profile {named}", fingerprint)


def _check_host_memory(
    wl: Workload, device: str, optimizer: str, momentum: float, what: str
) -> None:
    """A run whose processes all start on this host and compute on its CPU: the model held
    once with gradients and optimizer state fits the host memory available
    (:func:`dapple.profiler.host_fit.check_training_memory`); before any layer is built.
    Under torchrun each host holds only its own ranks' stages: not checked."""
    import os

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return
    from dapple.profiler.host_fit import check_training_memory
    from dapple.runtime.optim_config import OPTIMIZERS, state_factor

    if optimizer in OPTIMIZERS:  # another name is refused by the run's own checks
        check_training_memory(wl, state_factor(optimizer, momentum), what=what)


def _name(x: ModelProfile | Cluster | str | Path | None) -> str | None:
    """How an option given as an object or a path reads in messages."""
    if isinstance(x, ModelProfile):
        return x.model_name
    return x.name if isinstance(x, Cluster) else None if x is None else str(x)


def _seq_overrides(
    workload: WorkloadLike, overrides: Mapping[str, Any] | None, seq_len: int | None
) -> Mapping[str, Any] | None:
    """``overrides`` with ``seq=seq_len`` for a spec string (a built workload stays as is)."""
    if seq_len is None or not isinstance(workload, str):
        return overrides
    given = dict(overrides or {})
    if given.setdefault("seq", seq_len) != seq_len:
        raise ValidationError(f"overrides seq={given['seq']} disagrees with seq_len={seq_len}")
    return given


def _dataset(data: Any, seq_len: int | None, documents: str | None = None) -> Any:
    """A dataset as given, or the token file (``documents``: the documents) at a path."""
    from dapple.runtime.run_config import open_run_data

    return None if data is None else open_run_data(data, seq_len, documents)


VERIFY_CHECKS = ("rtol", "atol", "grad_rtol", "progress")
"""What :func:`verify` takes beside a :class:`~dapple.runtime.run_config.RunConfig`: the
tolerances and whether it says which run is going."""


@overload
def verify(plan: RunConfig, *, inputs: RunInputs | None = None, **checks: Any) -> VerifyReport: ...
@overload
def verify(
    plan: Plan | str | Path,
    workload: WorkloadLike,
    steps: int = 2,
    *,
    overrides: Mapping[str, Any] | None = None,
    schedule: str | None = None,
    policy: str | None = None,
    virtual_stages: int = 1,
    device: str = "auto",
    data: Any = None,
    seq_len: int | None = None,
    precision: str = "fp32",
    **options: Any,
) -> VerifyReport: ...
def verify(
    plan: RunConfig | Plan | str | Path,
    workload: WorkloadLike | None = None,
    steps: int = 2,
    *,
    overrides: Mapping[str, Any] | None = None,
    schedule: str | None = None,
    policy: str | None = None,
    virtual_stages: int = 1,
    device: str = "auto",
    data: Any = None,
    seq_len: int | None = None,
    precision: str = "fp32",
    inputs: RunInputs | None = None,
    **options: Any,
) -> VerifyReport:
    """Run a plan distributed and check it step by step against one process (``dapple verify``):
    ``verify(cfg)`` the run a :class:`~dapple.runtime.run_config.RunConfig` asks for (its model,
    plan, data and :class:`~dapple.runtime.TrainConfig`'s steps, seed, device, precision,
    timeout and optimisation options), ``verify(plan, workload, ...)`` the one its keyword
    arguments ask for.

    Args:
        plan: A :class:`~dapple.runtime.run_config.RunConfig` (then only ``inputs`` and
            :data:`VERIFY_CHECKS` go beside it), or a :class:`Plan` or its JSON path.
        workload: A :class:`Workload` or a spec string.
        steps: Optimizer steps of both runs.
        overrides: Factory keyword arguments when ``workload`` is a spec.
        schedule: ``gpipe``, ``dapple``, ``interleaved`` or ``zbh1`` instead of the plan's.
        policy: ``A`` or ``B`` instead of the plan's.
        virtual_stages: v, model chunks per device group with ``schedule="interleaved"``.
        device: Device of the distributed run: ``auto`` (``cuda`` when available, else
            ``cpu``), ``cpu`` or ``cuda``; the reference runs on the CPU.
        data: Training samples of both runs, a dataset or a token file path (as in
            :func:`train`).
        seq_len: As in :func:`train`.
        precision: ``fp32`` or ``bf16`` autocast in both runs (bf16 tolerances:
            :func:`dapple.runtime.precision.tolerances_for`).
        inputs: With a ``RunConfig``: what it names, already loaded (``dapple verify`` loads
            them naming its flags); None: loaded here (:func:`~dapple.api.run_inputs`).
        **options: ``seed``, ``optimizer``, ``lr``, ``rtol``, ``atol``, ``grad_rtol``,
            ``timeout_s``, ``progress`` (default True: which run is going, on stderr, as it
            goes) and the optimisation options ``weight_decay``, ``momentum``,
            ``betas``, ``eps``, ``lr_schedule``, ``warmup_steps``, ``min_lr``,
            ``clip_grad_norm``, ``zero_stage`` (see :func:`dapple.runtime.verify.verify_many`).

    Returns:
        A :class:`~dapple.runtime.verify.VerifyReport`; ``report.ok`` is the verdict.

    Raises:
        ValidationError: Bad plan, workload or options; a plan made for another model
            (:meth:`~dapple.core.plan.Plan.check_model`); a stage of tensor width t_s > 1
            the model cannot be cut over (:mod:`dapple.runtime.parallel.tensor_check`).
        RankFailure: A worker failed.
    """
    from dapple.runtime.run_config import RunConfig

    if isinstance(plan, RunConfig):
        return _verify_config(plan, inputs, options)
    if workload is None or inputs is not None:
        raise ValidationError(
            "verify(plan, workload, ...) needs a workload and takes no inputs (those go with a "
            "RunConfig: verify(cfg, inputs=...))"
        )
    run_plan = plan_with(plan, schedule, policy, virtual_stages)
    wl = as_workload(workload, _seq_overrides(workload, overrides, seq_len))
    _check_run(run_plan, wl)
    tc, checks = _verify_options(steps, device, precision, options)
    _check_host_memory(wl, tc.device, tc.optimizer, tc.momentum, "verifying")
    from dapple.runtime.verify import verify as _verify

    return _verify(run_plan, wl, tc, data=_dataset(data, seq_len), **checks)


def _verify_options(
    steps: int, device: str, precision: str, options: dict[str, Any]
) -> tuple[TrainConfig, dict[str, Any]]:
    """The keyword form's ``options`` of :func:`verify` as both runs' :class:`TrainConfig`
    (``seed`` 0, ``optimizer`` sgd, ``lr`` 0.01 and ``timeout_s`` 120 unless given) and the
    :data:`VERIFY_CHECKS` given.

    Raises:
        ValidationError: an option that is neither (naming the optimisation options), or a bad
            value.
    """
    from dapple.runtime.verify.reference import config

    checks = {k: v for k, v in options.items() if k in VERIFY_CHECKS}
    rest = {k: v for k, v in options.items() if k not in VERIFY_CHECKS}
    seed, optimizer = rest.pop("seed", 0), rest.pop("optimizer", "sgd")
    lr, timeout_s = rest.pop("lr", 0.01), rest.pop("timeout_s", 120.0)
    tc = dataclasses.replace(config(steps, seed, optimizer, lr, rest), timeout_s=timeout_s,
                             device=device, precision=precision)  # fmt: skip
    return tc, checks


def _verify_config(
    cfg: RunConfig, inputs: RunInputs | None, checks: dict[str, Any]
) -> VerifyReport:
    """:func:`verify` of a ``RunConfig``: its inputs (loaded here when not given) checked, then
    both runs with ``cfg.train``'s options and the ``checks`` (:data:`VERIFY_CHECKS`).

    Raises:
        ValidationError: an option beside ``cfg`` that it holds itself, or as :func:`verify`.
    """
    from dapple.runtime.run_config import resolve_verify_config
    from dapple.runtime.verify import verify as _verify

    extra = sorted(set(checks) - set(VERIFY_CHECKS))
    if extra:
        raise ValidationError(
            f"verify(cfg) takes the run's options from cfg, got also {', '.join(extra)}"
        )
    given = inputs or run_inputs(cfg)
    tc = resolve_verify_config(cfg.train)
    _check_run(given.plan, given.workload)
    _check_host_memory(given.workload, tc.device, tc.optimizer, tc.momentum, "verifying")
    return _verify(given.plan, given.workload, tc, data=given.data, **checks)


def verify_many(
    cases: Sequence[tuple[Plan | str | Path, WorkloadLike]],
    steps: int = 2,
    *,
    device: str = "auto",
    precision: str = "fp32",
    data: Any = None,
    **options: Any,
) -> list[VerifyReport]:
    """:func:`verify` several ``(plan, workload)`` pairs in ONE launch of worker processes.

    Spec strings are loaded once each (without overrides; pass a
    :func:`~dapple.models.spec.load` result for those).

    Args:
        cases: Plans (objects or paths) and workloads (objects or spec strings).
        steps: Optimizer steps of every run.
        device, precision: As in :func:`verify`.
        data: Training samples of every run, a dataset (see
            :func:`dapple.runtime.verify.verify_many`); None: the workloads' ``make_batch``.
        **options: As in :func:`verify` (no ``schedule``/``policy``: set them on the plans).

    Raises:
        ValidationError: Bad plan, workload or options; a plan made for another model
            (:meth:`~dapple.core.plan.Plan.check_model`); a stage of tensor width t_s > 1
            the model cannot be cut over (:mod:`dapple.runtime.parallel.tensor_check`).
        RankFailure: A worker failed.
    """
    from dapple.runtime.verify import verify_many as _verify_many

    loaded: dict[str, Workload] = {}
    resolved: list[tuple[Plan, Workload]] = []
    for p, w in cases:
        if isinstance(w, str):
            if w not in loaded:
                loaded[w] = as_workload(w, None)
            w = loaded[w]
        run_plan, wl = as_plan(p), as_workload(w, None)
        _check_run(run_plan, wl)
        resolved.append((run_plan, wl))
    tc, checks = _verify_options(steps, device, precision, options)
    return _verify_many(resolved, tc, data=data, **checks)


def generate(
    workload: WorkloadLike,
    prompt: str,
    max_new_tokens: int = 64,
    *,
    checkpoint: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    tokenizer: str | Path | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Generated:
    """Continue ``prompt`` with a trained causal language model (``dapple generate``), on the
    CPU (:func:`dapple.models.generate.generate_text`).

    Args:
        workload: A :class:`Workload` or a spec string; the model as it was trained.
        prompt: The text to continue.
        max_new_tokens: Tokens to add (generation does not stop at end-of-sequence).
        checkpoint: A checkpoint root (its newest complete checkpoint) or one
            ``step-NNNNNNNN`` directory; ``None``: the workload's own weights (pretrained ones
            with ``overrides={"weights": DIR}``).
        overrides: Factory keyword arguments when ``workload`` is a spec.
        tokenizer: A Hugging Face tokenizer directory; ``None``: an ``hf:DIR`` model's own
            tokenizer when DIR has one, else bytes (vocabulary 256).
        temperature: 0: greedy; above 0: sampled from ``softmax(logits / temperature)``.
        seed: Seed of the sampling.
        progress: Called after each new token with ``(done, max_new_tokens)``.

    Returns:
        A :class:`~dapple.models.generate.Generated`: ``text`` (the prompt and its
        continuation), ``ids``, ``prompt_tokens``, ``new_tokens``.

    Raises:
        ValidationError: An empty prompt, no checkpoint under ``checkpoint``, a tokenizer whose
            vocabulary does not fit the model's, a bad spec or temperature, a count outside
            1 .. :data:`~dapple.models.generate.MAX_NEW_TOKENS`.
        CheckpointError: A checkpoint of another model, or a damaged one.
    """
    from dapple.models.generate import check_request, generate_text, tokenizer_for
    from dapple.runtime.checkpoint import check_compatible, restore_stage
    from dapple.runtime.export import newest_checkpoint

    wl = as_workload(workload, overrides)
    tok = tokenizer_for(wl, tokenizer)
    check_request(tok, prompt, max_new_tokens, temperature)  # before the model is built
    ckpt = None if checkpoint is None else newest_checkpoint(checkpoint)
    if checkpoint is not None and ckpt is None:
        raise ValidationError(f"no complete checkpoint under {str(checkpoint)!r}")
    from dapple.profiler.host_fit import check_training_memory

    check_training_memory(wl, 0.0, what="generating with")  # the whole model, once
    model = wl.build_model(0)
    if ckpt is not None:
        check_compatible(ckpt, model_name=wl.name, num_layers=wl.num_layers)
        restore_stage(ckpt, model, 0)
    return generate_text(wl, model, prompt, max_new_tokens, tokenizer=tok,
                         temperature=temperature, seed=seed, progress=progress)  # fmt: skip
