"""The Python API's checking side: run a plan distributed and check it step by step against
one process (``dapple verify``).

:func:`verify` and :func:`verify_many`, re-exported by :mod:`dapple.api`. Both check the plan
against the model before any worker starts, and hand :mod:`dapple.runtime.verify` the resolved
:class:`~dapple.runtime.TrainConfig` both runs train with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dapple.api._checks import check_host, check_run, dataset, seq_overrides
from dapple.api._inputs import RunInputs, WorkloadLike, as_plan, as_workload, plan_with, run_inputs
from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.models.workload import Workload

if TYPE_CHECKING:
    from dapple.api.run_config import RunConfig
    from dapple.runtime.train_config import TrainConfig
    from dapple.runtime.verify import VerifyReport

__all__ = ["VERIFY_CHECKS", "verify", "verify_many"]


VERIFY_CHECKS = ("rtol", "atol", "grad_rtol", "progress")
"""What :func:`verify` takes beside a :class:`~dapple.api.run_config.RunConfig`: the
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
    ``verify(cfg)`` the run a :class:`~dapple.api.run_config.RunConfig` asks for (its model,
    plan, data and :class:`~dapple.runtime.TrainConfig`'s steps, seed, device, precision,
    timeout and optimisation options), ``verify(plan, workload, ...)`` the one its keyword
    arguments ask for.

    Args:
        plan: A :class:`~dapple.api.run_config.RunConfig` (then only ``inputs`` and
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
            :func:`~dapple.api.train`).
        seq_len: As in :func:`~dapple.api.train`.
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
    from dapple.api.run_config import RunConfig

    if isinstance(plan, RunConfig):
        return _verify_config(plan, inputs, options)
    if workload is None or inputs is not None:
        raise ValidationError(
            "verify(plan, workload, ...) needs a workload and takes no inputs (those go with a "
            "RunConfig: verify(cfg, inputs=...))"
        )
    run_plan = plan_with(plan, schedule, policy, virtual_stages)
    wl = as_workload(workload, seq_overrides(workload, overrides, seq_len))
    check_run(run_plan, wl)
    tc, checks = _verify_options(steps, device, precision, options)
    _check_verify_host(wl, tc, run_plan)
    from dapple.runtime.verify import verify as _verify

    return _verify(run_plan, wl, tc, data=dataset(data, seq_len), **checks)


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
    from dapple.api.run_config import resolve_verify_config
    from dapple.runtime.verify import verify as _verify

    extra = sorted(set(checks) - set(VERIFY_CHECKS))
    if extra:
        raise ValidationError(
            f"verify(cfg) takes the run's options from cfg, got also {', '.join(extra)}"
        )
    given = inputs or run_inputs(cfg)
    tc = resolve_verify_config(cfg.train)
    check_run(given.plan, given.workload)
    _check_verify_host(given.workload, tc, given.plan)
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
        check_run(run_plan, wl)
        resolved.append((run_plan, wl))
    tc, checks = _verify_options(steps, device, precision, options)
    for run_plan, wl in resolved:
        _check_mesh(run_plan, wl, tc)
    return _verify_many(resolved, tc, data=data, **checks)


def _check_verify_host(wl: Workload, tc: TrainConfig, plan: Plan) -> None:
    """Verify's options that need no host first (a precision verify cannot judge, such as fp16,
    is refused whatever the device; what the plan's cut stages cannot run with them), then
    :func:`check_host`."""
    from dapple.runtime.precision import check_verify_precision

    check_verify_precision(tc.precision, tc.device)
    _check_mesh(plan, wl, tc)
    check_host(wl, tc.device, tc.optimizer, tc.momentum, "verifying")


def _check_mesh(plan: Plan, wl: Workload, tc: TrainConfig) -> None:
    """What stages of t_s > 1, ZeRO-3 or e_s > 1 cannot run with ``tc``, refused once here
    rather than by every worker (:func:`~dapple.runtime.parallel.stage_mesh.check_mesh_run`)."""
    from dapple.runtime.parallel.stage_mesh import check_mesh_run

    check_mesh_run(plan, wl, tc)
