"""Python API: profile, plan, simulate, train and verify from a script or a notebook.

Every function takes the objects the CLI reads and writes (:class:`~dapple.core.profile.ModelProfile`,
:class:`~dapple.core.cluster.Cluster`, :class:`~dapple.core.plan.Plan`) or the paths of their JSON files,
and a model as a :class:`~dapple.models.workload.Workload` or a spec string (a zoo name,
``package.module:factory`` or ``path/to/file.py:factory``) with keyword ``overrides`` for the
factory (``--set KEY=VALUE`` and ``--split-at`` on the command line)::

    import dapple.api as dp

    prof = dp.profile("dapple.models.hf:gpt2", batch_sizes=[1, 2, 4], overrides={"layers": 2})
    plan = dp.plan(prof, "local-cpu", global_batch_size=8)
    print(dp.simulate(plan, prof, "local-cpu").step_ms)
    report = dp.verify(plan, "dapple.models.hf:gpt2", steps=2, overrides={"layers": 2})
    assert report.ok

Workloads loaded from a spec (:func:`load`) pickle as their spec: spawned worker processes load
them again, so models defined in a ``file.py`` train and verify like installed ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dapple.core.cluster import Cluster, load_cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.spec import load
from dapple.models.workload import Workload
from dapple.schedule.registry import check_virtual_stages

if TYPE_CHECKING:
    from dapple.models.generate import Generated
    from dapple.runtime import StepMetrics
    from dapple.runtime.early import EarlyWorkers
    from dapple.runtime.verify import VerifyReport
    from dapple.simulate import SimResult

__all__ = [
    "generate",
    "load",
    "plan",
    "plan_local",
    "profile",
    "simulate",
    "train",
    "verify",
    "verify_many",
]

WorkloadLike = Workload | str
"""A :class:`Workload` or a spec string for :func:`load`."""


def _workload(workload: WorkloadLike, overrides: Mapping[str, Any] | None) -> Workload:
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


def _plan(plan: Plan | str | Path) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.load(plan)


def _profile(profile: ModelProfile | str | Path) -> ModelProfile:
    from dapple.profiler.paper_models import load_profile

    return profile if isinstance(profile, ModelProfile) else load_profile(profile)


def _cluster(cluster: Cluster | str, servers: int | None = None) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster if servers is None else cluster.with_servers(servers)
    return load_cluster(cluster, servers)


def _global_batch(profile: ModelProfile | str | Path, given: int | None) -> int:
    """G as given, or the paper's for a ``paper:NAME`` profile (else a ValidationError)."""
    from dapple.profiler.paper_models import PAPER_GLOBAL_BATCH, paper_name

    if given is not None:
        return given
    name = paper_name(profile) if isinstance(profile, str) else None
    if name is None:
        raise ValidationError("global_batch_size is required for a profile that is not paper:NAME")
    return PAPER_GLOBAL_BATCH[name]


def profile(
    workload: WorkloadLike,
    batch_sizes: Sequence[int] = (1, 2, 4),
    device: str = "auto",
    *,
    overrides: Mapping[str, Any] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    num_threads: int | None = 1,
    co_workers: int = 1,
    output: str | Path | None = None,
    precision: str = "fp32",
    split_backward: bool = False,
    seq_lens: Sequence[int] | None = None,
) -> ModelProfile:
    """Measure every layer of a model (``dapple profile``).

    Args:
        workload: A :class:`Workload` or a spec string.
        batch_sizes: Batch sizes to time (the fit is affine in the batch size).
        device: ``auto`` (``cuda`` when available, else ``cpu``), ``cpu`` or ``cuda[:N]``.
        overrides: Factory keyword arguments when ``workload`` is a spec.
        repeats: Timed runs per layer and batch size (median kept).
        warmup: Untimed runs first.
        num_threads: Torch threads on CPU while profiling (``None``: unchanged).
        co_workers: CPU: profile as one of this many local workers sharing the cores (CPU
            time while the others train the model; see ``profile_workload``).
        output: Also save the profile JSON here.
        precision: ``fp32``, ``bf16`` or ``fp16`` autocast while measuring (recorded in the
            profile; the planner's memory model follows it).
        split_backward: Also time each backward's input- and weight-gradient halves
            (zero-bubble ``I`` and ``W``) as the runtime runs them, recorded as
            ``LayerProfile.backward_input`` and ``backward_weight``.
        seq_lens: Also measure at these lengths of the model's dynamic (sequence) dimension:
            its own batches cut or tiled to each length, same layers
            (:mod:`dapple.profiler.lengths`); :func:`plan` with ``seq_len`` interpolates
            between them in tokens.

    Raises:
        ValidationError: Bad model spec, batch sizes, device, precision, or lengths (a model
            without a dynamic dimension, a length outside its range).
    """
    from dapple.profiler.measure import profile_workload

    prof = profile_workload(
        _workload(workload, overrides),
        list(batch_sizes),
        device=device,
        warmup=warmup,
        repeats=repeats,
        num_threads=num_threads,
        co_workers=co_workers,
        precision=precision,
        split_backward=split_backward,
        seq_lens=seq_lens,
    )
    if output is not None:
        prof.save(output)
    return prof


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
    seq_len: float | None = None,
    max_seq_len: float | None = None,
    zero_stage: int | str = 0,
    tensor_widths: str | Sequence[int] = "auto",
) -> Plan:
    """Plan a profiled model on a cluster (``dapple plan``).

    Args:
        profile: A :class:`ModelProfile`, its JSON path, or ``paper:NAME`` for a shipped paper
            profile (:data:`dapple.profiler.paper_models.PAPER_MODELS`).
        cluster: A :class:`Cluster`, a preset name (``local-cpu``, ``paper-a``...) or a file.
        global_batch_size: Samples per optimizer step (None: the paper's, for a ``paper:NAME``
            profile).
        planner: ``dapple`` or a baseline (see :data:`dapple.planner.PLANNERS`).
        servers: Another number of servers than the cluster's.
        output: Also save the plan JSON here.
        schedule: Run the planned stages under ``gpipe``, ``dapple``, ``interleaved`` or
            ``zbh1`` instead of the planner's choice (``dapple plan --schedule``); the
            predicted step is that schedule's
            (:func:`dapple.planner.schedules.schedule_latency`). ``best``: the fastest
            simulated plan over every schedule and M that fits the memory
            (:func:`dapple.simulate.schedules.best_schedule`).
        virtual_stages: v, model chunks per device group with ``schedule="interleaved"``.
        seq_len: Mean tokens per sample to plan the step time for, from a profile measured at
            several lengths (``profile(seq_lens=...)``; ``dapple plan --seq-len MEAN,MAX``).
        max_seq_len: Longest sample, which the memory is planned for (default ``seq_len``).
        zero_stage: 1: replicated stages shard their optimizer state (ZeRO-1); 2: their
            gradients too (ZeRO-2); 3: their parameters too (ZeRO-3, gathered once per step or
            per micro-batch); ``"auto"``: per stage, where memory asks for it (dapple planner
            only; the plan records each stage's, which :func:`train` follows).
        tensor_widths: The tensor widths t to search (each of 1, 2, 4, 8, dividing the server
            size; dapple planner only), or ``"auto"``: 1, and every width that fits when some
            layer of the profile shards (``LayerProfile.tensor_parallel``).

    Raises:
        ValidationError: Unknown planner or schedule, bad batch size, bad files, lengths
            without a profile measured at several, v not dividing a device group's layers,
            tensor widths that cannot be searched (t > 1 for a profile where no layer shards).
        InfeasibleError: No plan fits the devices' memory.
    """
    from dapple.planner import make_plan
    from dapple.planner.config import PlanConfig, tensor_width_list, zero_stage_number

    widths = tensor_widths if isinstance(tensor_widths, str) else tuple(tensor_widths)
    cfg = PlanConfig(  # the checks of `dapple plan` and its config file
        servers=servers, global_batch_size=global_batch_size, planner=planner,
        zero_stage=zero_stage, tensor_widths=widths,
    )  # fmt: skip
    prof, cl = _profile(profile), _cluster(cluster, servers)
    result = make_plan(
        prof,
        cl,
        _global_batch(profile, global_batch_size),
        planner,
        seq_len=seq_len,
        max_seq_len=max_seq_len,
        zero_stage=zero_stage_number(zero_stage),
        tensor_widths=tensor_width_list(cfg.tensor_widths),
    )
    if schedule == "best":
        from dapple.simulate.schedules import best_schedule

        chosen = best_schedule(result, prof, cl)[0].plan
        assert chosen is not None
        result = chosen
    elif schedule is not None:
        from dapple.planner.schedules import schedule_latency
        from dapple.simulate.schedules import with_schedule

        result = with_schedule(result, schedule, virtual_stages)
        result = dataclasses.replace(result, predicted_step_ms=schedule_latency(result, prof, cl))
    else:
        check_virtual_stages(virtual_stages, None)
    if output is not None:
        result.save(output)
    return result


def plan_local(
    workload: WorkloadLike,
    global_batch_size: int,
    nprocs: Sequence[int] = (2, 4),
    *,
    overrides: Mapping[str, Any] | None = None,
    repeats: int = 5,
) -> Plan:
    """The best plan for this machine's CPU cores over local process counts ``nprocs``: each
    count is profiled as co-located workers, calibrated and planned; the lowest predicted L
    wins (:func:`dapple.calibrate.local.plan_local`, which also returns every candidate).

    Raises:
        ValidationError: a bad model spec or a count below 2.
    """
    from dapple.calibrate.local import plan_local as _plan_local

    best, _ = _plan_local(
        _workload(workload, overrides), global_batch_size, nprocs, repeats=repeats
    )
    return best.plan


def simulate(
    plan: Plan | str | Path,
    profile: ModelProfile | str | Path,
    cluster: Cluster | str,
    *,
    schedule: str | None = None,
    policy: str | None = None,
    virtual_stages: int = 1,
) -> SimResult:
    """Simulate one step of a plan (``dapple simulate``).

    Args:
        plan: A :class:`Plan` or its JSON path.
        profile: A :class:`ModelProfile`, its JSON path, or ``paper:NAME``.
        cluster: A :class:`Cluster`, a preset name or a file.
        schedule: ``gpipe``, ``dapple``, ``interleaved`` or ``zbh1`` instead of the plan's.
        policy: ``A`` or ``B`` instead of the plan's.
        virtual_stages: v, model chunks per device group with ``schedule="interleaved"``.

    Raises:
        ValidationError: The plan does not fit the profile or cluster, or the schedule does not
            fit the plan (v not dividing a device group's layers, M not a multiple of the
            groups).
    """
    from dapple.simulate import simulate as _simulate

    p = _with(plan, schedule, policy, virtual_stages)
    return _simulate(p, _profile(profile), _cluster(cluster))


def _with(
    plan: Plan | str | Path, schedule: str | None, policy: str | None, virtual_stages: int = 1
) -> Plan:
    """``plan`` under ``schedule`` (with v chunks for ``interleaved``,
    :func:`dapple.simulate.schedules.with_schedule`) and ``policy``, each when given."""
    from dapple.simulate.schedules import with_schedule

    p = _plan(plan)
    if schedule is not None:
        return with_schedule(p, schedule, virtual_stages, policy)
    check_virtual_stages(virtual_stages, None)
    if policy is not None:
        p = dataclasses.replace(p, policy=cast(Any, policy))
    return p


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
) -> list[StepMetrics]:
    """Train a plan for ``steps`` synchronous steps (``dapple train``; the options of a run file,
    :class:`~dapple.runtime.run_config.RunConfig`, with the same names and defaults).

    Args:
        plan: A :class:`Plan` or its JSON path.
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
            (:mod:`dapple.runtime.elastic`); the metrics then hold every attempt's steps.
        early: Workers already started for this run (``dapple train`` starts them first).
        **options: The other :class:`dapple.runtime.TrainConfig` fields (``seed``,
            ``optimizer``, ``lr``, ``weight_decay``, ``zero_stage``, ``device``,
            ``metrics_path``, ``checkpoint_dir``, ``save_every``, ``resume``, ``eval_every``,
            ``precision``, ``echo``...).

    Returns:
        Rank 0's metrics of every step.

    Raises:
        ValidationError: Bad plan, workload or options; a plan made for another model
            (:meth:`~dapple.core.plan.Plan.check_model`); a stage of tensor width t_s > 1
            the model cannot be cut over (:mod:`dapple.runtime.tensor_check`).
        CheckpointError: ``require_resume`` and no checkpoint to resume.
        RankFailure: A worker failed.
    """
    from dapple.runtime import train as _train
    from dapple.runtime.config import TrainConfig
    from dapple.runtime.run_config import RunOptions, check_resumable, resolve_train_config
    from dapple.runtime.stage_mesh import check_mesh_run

    run = RunOptions(keep=keep or 0, eval_batches=eval_batches, require_resume=require_resume,
                     elastic=elastic, min_devices=min_devices, max_restarts=max_restarts,
                     profile=_name(profile), cluster=_name(cluster))  # fmt: skip
    run_plan = _with(plan, schedule, policy, virtual_stages)
    wl = _workload(workload, _seq_overrides(workload, overrides, seq_len))
    _check_run(run_plan, wl, None if cluster is None else _cluster(cluster, None))
    train_data = _dataset(data, seq_len, documents)
    evals = _dataset(eval_data, seq_len, documents)
    G, n_eval = run_plan.global_batch_size, None if evals is None else len(evals)
    cfg = resolve_train_config(TrainConfig(steps=steps, **options), run, n_eval, G)
    check_mesh_run(run_plan, wl, cfg)  # what stages of t_s > 1 or ZeRO-3 cannot run yet
    if profile is not None and cluster is not None:
        predicted = simulate(run_plan, profile, cluster).step_ms
        cfg = dataclasses.replace(cfg, predicted_step_ms=predicted)
    if require_resume:
        check_resumable(cfg.checkpoint_dir)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    from dapple.runtime.elastic import ElasticPolicy

    replan: ElasticPolicy | None = None
    if elastic and profile is not None and cluster is not None:
        replan = ElasticPolicy(_profile(profile), _cluster(cluster), min_devices=min_devices,
                               max_restarts=max_restarts, zero_stage=cfg.zero_stage)  # fmt: skip
    return _train(run_plan, wl, data=train_data, eval_data=evals, early=early, elastic=replan,
                  **fields)  # fmt: skip


def _check_run(plan: Plan, wl: Workload, cluster: Cluster | None = None) -> None:
    """The plan was made for this model (:meth:`~dapple.core.plan.Plan.check_model`) and its
    tensor groups can cut it (:func:`dapple.runtime.tensor_check.check_tensor_run`)."""
    from dapple.runtime.tensor_check import check_tensor_run

    plan.check_model(wl.name, wl.num_layers)
    check_tensor_run(plan, wl, cluster)


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
) -> VerifyReport:
    """Run a plan distributed and check it step by step against one process (``dapple verify``).

    Args:
        plan: A :class:`Plan` or its JSON path.
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
        **options: ``seed``, ``optimizer``, ``lr``, ``rtol``, ``atol``, ``grad_rtol``,
            ``timeout_s`` and the optimisation options ``weight_decay``, ``momentum``,
            ``betas``, ``eps``, ``lr_schedule``, ``warmup_steps``, ``min_lr``,
            ``clip_grad_norm``, ``zero_stage`` (see :func:`dapple.runtime.verify.verify_many`).

    Returns:
        A :class:`~dapple.runtime.verify.VerifyReport`; ``report.ok`` is the verdict.

    Raises:
        ValidationError: Bad plan, workload or options; a plan made for another model
            (:meth:`~dapple.core.plan.Plan.check_model`); a stage of tensor width t_s > 1
            the model cannot be cut over (:mod:`dapple.runtime.tensor_check`).
        RankFailure: A worker failed.
    """
    run_plan = _with(plan, schedule, policy, virtual_stages)
    wl = _workload(workload, _seq_overrides(workload, overrides, seq_len))
    _check_run(run_plan, wl)
    from dapple.runtime.verify import verify as _verify

    return _verify(
        run_plan,
        wl,
        steps,
        device=device,
        data=_dataset(data, seq_len),
        precision=precision,
        **options,
    )


def verify_many(
    cases: Sequence[tuple[Plan | str | Path, WorkloadLike]],
    steps: int = 2,
    *,
    device: str = "auto",
    **options: Any,
) -> list[VerifyReport]:
    """:func:`verify` several ``(plan, workload)`` pairs in ONE launch of worker processes.

    Spec strings are loaded once each (without overrides; pass a :func:`load` result for
    those).

    Args:
        cases: Plans (objects or paths) and workloads (objects or spec strings).
        steps: Optimizer steps of every run.
        device: As in :func:`verify` (default ``auto``).
        **options: As in :func:`verify` (no ``schedule``/``policy``: set them on the plans).

    Raises:
        ValidationError: Bad plan, workload or options; a plan made for another model
            (:meth:`~dapple.core.plan.Plan.check_model`); a stage of tensor width t_s > 1
            the model cannot be cut over (:mod:`dapple.runtime.tensor_check`).
        RankFailure: A worker failed.
    """
    from dapple.runtime.verify import verify_many as _verify_many

    loaded: dict[str, Workload] = {}
    resolved: list[tuple[Plan, Workload]] = []
    for p, w in cases:
        if isinstance(w, str):
            if w not in loaded:
                loaded[w] = _workload(w, None)
            w = loaded[w]
        run_plan, wl = _plan(p), _workload(w, None)
        _check_run(run_plan, wl)
        resolved.append((run_plan, wl))
    return _verify_many(resolved, steps, device=device, **options)


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

    Returns:
        A :class:`~dapple.models.generate.Generated`: ``text`` (the prompt and its
        continuation), ``ids``, ``prompt_tokens``, ``new_tokens``.

    Raises:
        ValidationError: An empty prompt, no checkpoint under ``checkpoint``, a tokenizer whose
            vocabulary does not fit the model's, a bad spec, count or temperature.
        CheckpointError: A checkpoint of another model, or a damaged one.
    """
    from dapple.models.generate import check_request, generate_text, tokenizer_for
    from dapple.runtime.checkpoint import check_compatible, restore_stage
    from dapple.runtime.export import newest_checkpoint

    wl = _workload(workload, overrides)
    tok = tokenizer_for(wl, tokenizer)
    check_request(tok, prompt, max_new_tokens, temperature)  # before the model is built
    ckpt = None if checkpoint is None else newest_checkpoint(checkpoint)
    if checkpoint is not None and ckpt is None:
        raise ValidationError(f"no complete checkpoint under {str(checkpoint)!r}")
    model = wl.build_model(0)
    if ckpt is not None:
        check_compatible(ckpt, model_name=wl.name, num_layers=wl.num_layers)
        restore_stage(ckpt, model, 0)
    return generate_text(
        wl, model, prompt, max_new_tokens, tokenizer=tok, temperature=temperature, seed=seed
    )
