"""Check a distributed run against one process: same seed, same batches, same optimizer.

``verify`` trains a plan with the runtime (one process per plan device, gloo/NCCL) and the same
steps in this process on the unsplit model, then compares every parameter after the last step
(``torch.testing.assert_close`` float32 tolerances by default; with ``precision="bf16"`` both
runs autocast and the tolerances are :func:`dapple.runtime.precision.tolerances_for`), the loss
of every step and the global gradient norm of every step (relative tolerance
:data:`GRAD_NORM_RTOL`, the bf16 ``rtol`` under bf16).

Design choices:
    - The reference is the *original* model when the workload was made by
      :func:`dapple.models.split.workload_from_module` (``original_model``: tied weights are one
      parameter there, so this also checks the cut and the tied-gradient sums), otherwise the
      layer chain ``workload.build_model(seed)`` with tied gradients summed by
      :func:`dapple.models.tied.sum_tied_grads_local`.
    - The reference takes one full-batch step (``loss_fn`` over all ``G`` samples): what the
      plan's micro-batches, split-concat slices and AllReduces must add up to.
    - Both runs use the same optimizer and parameter groups, lr schedule and clipping
      (:mod:`dapple.runtime.optim`); the reference clips with ``torch.nn.utils`` over the
      original model's parameters (the layer chain: every tied group's first copy once), so
      its pre-clip norm is the number the distributed run's count must reproduce.
    - The distributed side returns its weights through files: each rank writes its layers'
      parameters to a temporary directory after the run (every replica, so replicas that drift
      apart are caught too); rank 0 adds the per-step losses. Several plans run in ONE launch
      of ``max(devices)`` processes (ranks outside a plan idle through its collectives).
    - Test hook: with ``DAPPLE_TEST_PERTURB_GRAD_RANK=k`` rank ``k`` adds ``PERTURBATION`` to
      every gradient of its layers, so a test can watch verification fail.

Dropout must be off (the reference draws other random numbers than the ranks).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from dapple.core.plan import Plan
from dapple.datasets import BatchSource
from dapple.errors import DappleError, ValidationError
from dapple.models.shapes import check_steps
from dapple.models.split import original_model, sum_tied_grads_local
from dapple.models.workload import Workload
from dapple.runtime import (
    TrainConfig,
    init_distributed,
    run_plan,
    shutdown_distributed,
    spawn,
    validate_run,
)
from dapple.runtime.data import check_data, fit_data, fit_workload
from dapple.runtime.optim import config_lr, make_optimizer, set_lr
from dapple.runtime.optim_config import OPTIM_FIELDS
from dapple.runtime.precision import autocast_reference, check_verify_precision, tolerances_for

__all__ = [
    "ATOL",
    "GRAD_NORM_RTOL",
    "PERTURBATION",
    "PERTURB_GRAD_RANK_ENV",
    "RTOL",
    "StageDiff",
    "VerifyReport",
    "reference_run",
    "verify",
    "verify_many",
]

log = logging.getLogger(__name__)

RTOL = 1.3e-6
"""Default relative tolerance (``torch.testing.assert_close`` for float32)."""
ATOL = 1e-5
"""Default absolute tolerance (``torch.testing.assert_close`` for float32)."""
PERTURB_GRAD_RANK_ENV = "DAPPLE_TEST_PERTURB_GRAD_RANK"
"""Test hook: the rank whose gradients get ``PERTURBATION`` added (verification must fail)."""
PERTURBATION = 1e-2
GRAD_NORM_RTOL = 1e-4
"""Relative tolerance of each step's global gradient norm: float32 norms of gradients that
differ by float32 rounding (any miscount of a parameter is off by far more)."""

Params = dict[int, dict[str, torch.Tensor]]
"""Layer index -> parameter name (as in the layer) -> value."""


@dataclass(frozen=True, slots=True)
class StageDiff:
    """How far one stage's parameters (all replicas) ended from the reference."""

    stage: int
    layers: tuple[int, int]
    """Layer range ``[start, end)``."""
    replicas: int
    num_params: int
    """Parameter elements of the stage (one replica)."""
    max_abs_diff: float
    """Largest ``|distributed - reference|`` over the stage's parameters and replicas."""
    max_rel_diff: float
    """Largest ``|distributed - reference| / |reference|`` over elements with ``|reference| >
    atol`` (smaller ones are judged by the absolute tolerance; 0 if there are none)."""
    ok: bool
    """Every element within ``atol + rtol * |reference|``."""
    worst: str = ""
    """The parameter with the largest absolute difference, ``layer i name``."""


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Result of :func:`verify`: per-stage parameter differences and per-step losses."""

    plan: Plan
    model_name: str
    reference: str
    """``original model`` or ``layer chain`` (see the module docstring)."""
    stages: tuple[StageDiff, ...]
    losses: tuple[float, ...]
    """Distributed loss of each step (before its update)."""
    reference_losses: tuple[float, ...]
    rtol: float = RTOL
    atol: float = ATOL
    options: dict[str, Any] = field(default_factory=dict)
    """Seed, optimizer, learning rate and the other optimisation options of both runs."""
    grad_norms: tuple[float, ...] = ()
    """Distributed global gradient norm of each step, before clipping."""
    reference_grad_norms: tuple[float, ...] = ()
    grad_norm_rtol: float = GRAD_NORM_RTOL

    @property
    def ok(self) -> bool:
        """Every parameter of every stage and every step's gradient norm within tolerance."""
        return all(s.ok for s in self.stages) and self.grad_norms_ok

    @property
    def grad_norms_ok(self) -> bool:
        """Every step's global gradient norm within ``grad_norm_rtol`` of the reference's."""
        if len(self.grad_norms) != len(self.reference_grad_norms):
            return False
        return all(
            abs(a - b) <= self.grad_norm_rtol * abs(b)
            for a, b in zip(self.grad_norms, self.reference_grad_norms, strict=True)
        )

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.stages), default=0.0)

    @property
    def max_loss_diff(self) -> float:
        return max(
            (abs(a - b) for a, b in zip(self.losses, self.reference_losses, strict=True)),
            default=0.0,
        )


# ----------------------------------------------------------------------- single-process side
def _call(model: nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


def reference_run(
    workload: Workload,
    global_batch_size: int,
    steps: int,
    *,
    seed: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.01,
    data: Dataset[Any] | None = None,
    precision: str = "fp32",
    **optim: Any,
) -> tuple[list[float], Params, str]:
    """Train ``steps`` full-batch steps in this process, as the runtime would on one device.

    Args:
        workload: The model, data and loss.
        global_batch_size: Samples per step (``make_batch(G, seed + step)``).
        steps: Optimizer steps.
        seed: Weights seed (``build_model(seed)`` / ``original_model(workload, seed)``).
        optimizer: ``sgd``, ``adam`` or ``adamw``.
        lr: Learning rate (the schedule's peak).
        **optim: The other optimisation fields of :class:`TrainConfig`
            (:data:`~dapple.runtime.optim_config.OPTIM_FIELDS`).
        data: Training samples; step ``t`` takes the global batch the runtime's sampler picks
            (:class:`~dapple.datasets.BatchSource`, seeded by ``seed``). None: ``make_batch``.
        precision: ``fp32`` or ``bf16``: the forward runs under the runtime's CPU autocast,
            the loss in fp32.

    Returns:
        The loss of each step, the final parameters per layer (named as in the layers) and
        which reference ran (``original model`` or ``layer chain``).

    Raises:
        ValidationError: Bad optimisation options.
    """
    cfg = replace(_config(steps, seed, optimizer, lr, optim), precision=precision)
    ref = _reference(workload, global_batch_size, cfg, data)
    return ref.losses, ref.params, ref.kind


def _config(steps: int, seed: int, optimizer: str, lr: float, optim: dict[str, Any]) -> TrainConfig:
    unknown = sorted(set(optim) - set(OPTIM_FIELDS))
    if unknown:
        raise ValidationError(
            f"unknown options {unknown}; the optimisation options are {', '.join(OPTIM_FIELDS)}"
        )
    return TrainConfig(steps=steps, seed=seed, optimizer=optimizer, lr=lr, **optim)


@dataclass
class _Reference:
    losses: list[float]
    params: Params
    kind: str
    grad_norms: list[float]


def _reference(
    workload: Workload,
    global_batch_size: int,
    cfg: TrainConfig,
    data: Dataset[Any] | None = None,
) -> _Reference:
    """:func:`reference_run`, also returning each step's pre-clip global gradient norm."""
    workload = fit_workload(workload, data)
    seed = cfg.seed
    chain = workload.build_model(seed)
    try:
        model: nn.Module = original_model(workload, seed)
        kind = "original model"
    except ValidationError:
        model, kind = chain, "layer chain"
    model.train()
    params = list(model.parameters())
    opt = make_optimizer(cfg, params)
    # the parameters of the original model, once each: the chain counts a tied group's
    # first copy only (after the tied sums every copy holds the whole gradient)
    counted = params
    if model is chain:
        copies = {id(chain[i].get_parameter(n)) for g in workload.tied_parameters for i, n in g}
        firsts = {
            id(chain[i].get_parameter(n))
            for g in workload.tied_parameters
            for i, n in [min((int(i), str(n)) for i, n in g)]
        }
        counted = [p for p in params if id(p) not in copies - firsts]
    losses: list[float] = []
    norms: list[float] = []
    every = range(global_batch_size)
    data = fit_data(workload, data, seed)
    source = (
        BatchSource(data, global_batch_size, seed, every, every, prefetch=False)
        if data is not None
        else None
    )
    for step in range(cfg.steps):
        if source is not None:
            inputs, targets = source.batch(step)
        else:
            inputs, targets = workload.make_batch(global_batch_size, seed + step)
        opt.zero_grad(set_to_none=True)
        with autocast_reference(cfg.precision) as cast:
            output = _call(model, inputs)
        loss = workload.loss_fn(cast(output), targets)
        torch.autograd.backward([loss])
        if model is chain:
            sum_tied_grads_local(list(chain), workload.tied_parameters)
        grads = [p.grad for p in counted if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if cfg.clip_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, cfg.clip_grad_norm, total)
        set_lr(opt, config_lr(cfg, step))
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(float(total))
    out: Params = {}
    for i, layer in enumerate(chain):
        names = [n for n, _ in layer.named_parameters()]
        if model is chain:
            out[i] = {n: p.detach().clone() for n, p in layer.named_parameters()}
        else:  # a piece's parameter names are the original model's qualified names
            out[i] = {n: model.get_parameter(n).detach().clone() for n in names}
    return _Reference(losses, out, kind, norms)


# ------------------------------------------------------------------------- distributed side
class _Perturbed:
    """Layer factory adding ``PERTURBATION`` to the gradient of every parameter it builds."""

    def __init__(self, factory: Callable[[], nn.Module]) -> None:
        self.factory = factory

    def __call__(self) -> nn.Module:
        layer = self.factory()
        for p in layer.parameters():
            cast(Any, p).register_hook(lambda g: g + PERTURBATION)
        return layer


def _perturbed(workload: Workload) -> Workload:
    return replace(workload, layer_factories=[_Perturbed(f) for f in workload.layer_factories])


def _die(msg: str) -> None:
    sys.stdout.flush()
    os.write(2, f"dapple: error: {msg}\n".encode())
    os._exit(1)


def _worker(
    rank: int,
    world: int,
    cases: list[tuple[dict[str, Any], Workload]],
    cfg: TrainConfig,
    out: str,
    data: Dataset[Any] | None = None,
) -> None:
    """One rank: run every case's plan in turn and write this rank's layers after each."""
    try:
        device = init_distributed(cfg, world)
        perturb = rank == int(os.environ.get(PERTURB_GRAD_RANK_ENV, "-1"))
        for c, (plan_d, wl) in enumerate(cases):
            plan = Plan.from_dict(plan_d)
            run = run_plan(
                plan,
                _perturbed(wl) if perturb else wl,
                cfg,
                device=device,
                exact_world=False,
                data=data,
            )
            if run.module is not None and run.stage is not None:
                layers = {
                    i: {n: p.detach().cpu() for n, p in layer.named_parameters()}
                    for i, layer in zip(
                        plan.layers_of_device(rank), run.module.children(), strict=True
                    )
                }
                stages = list(plan.stages_of_device(rank))
                torch.save(
                    {"stages": stages, "replica": run.replica, "layers": layers},
                    Path(out, f"case{c}-rank{rank}.pt"),
                )
            if rank == 0:
                losses = [m.loss for m in run.metrics]
                norms = [m.grad_norm for m in run.metrics]
                Path(out, f"case{c}-losses.json").write_text(json.dumps([losses, norms]))
        shutdown_distributed()
    except Exception as e:
        _die(str(e) if isinstance(e, DappleError) else f"rank {rank}: {type(e).__name__}: {e}")


def _stage_diffs(
    plan: Plan, reference: Params, runs: list[dict[str, Any]], rtol: float, atol: float
) -> tuple[StageDiff, ...]:
    out = []
    for s, st in enumerate(plan.stages):
        lo, hi = st.layers
        mine = [r for r in runs if s in r["stages"]]
        if len(mine) != st.replicas:
            raise ValidationError(
                f"stage {s}: got the weights of {len(mine)} replicas, expected {st.replicas}"
            )
        n_el, max_abs, max_rel, ok, worst = 0, 0.0, 0.0, True, ""
        for i in range(lo, hi):
            for name, ref in reference[i].items():
                n_el += ref.numel()
                for r in mine:
                    got = r["layers"][i].get(name)
                    if got is None or got.shape != ref.shape:
                        raise ValidationError(
                            f"stage {s} replica {r['replica']}: layer {i} parameter {name!r} "
                            "missing or of another shape than the reference"
                        )
                    diff = (got.double() - ref.double()).abs()
                    if diff.numel() == 0:
                        continue
                    a = float(diff.max())
                    mag = ref.double().abs()
                    big = mag > atol
                    rel = float((diff[big] / mag[big]).max()) if big.any() else 0.0
                    ok = ok and bool((diff <= atol + rtol * mag).all())
                    if a > max_abs or not worst:
                        max_abs, worst = max(a, max_abs), f"layer {i} {name}"
                    max_rel = max(max_rel, rel)
        out.append(StageDiff(s, (lo, hi), st.replicas, n_el, max_abs, max_rel, ok, worst))
    return tuple(out)


def verify_many(
    cases: Sequence[tuple[Plan, Workload]],
    steps: int = 2,
    *,
    seed: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.01,
    rtol: float | None = None,
    atol: float | None = None,
    timeout_s: float = 120.0,
    device: str = "cpu",
    data: Dataset[Any] | None = None,
    precision: str = "fp32",
    **optim: Any,
) -> list[VerifyReport]:
    """:func:`verify` several ``(plan, workload)`` pairs with ONE launch of worker processes.

    ``max(len(plan.devices))`` processes start once and run the plans one after the other;
    the single-process references run here (once per workload and global batch size).

    Args:
        cases: Plans and the workloads they train (workloads must pickle: spec-loaded ones from
            :func:`dapple.api.load` or ``dapple.models.hf`` do).
        steps: Optimizer steps of every run.
        seed: Weights seed; step ``t`` uses batch seed ``seed + t``.
        optimizer: ``sgd``, ``adam`` or ``adamw``.
        lr: Learning rate (the schedule's peak).
        rtol: Relative tolerance per parameter element (None: ``tolerances_for(precision)``).
        atol: Absolute tolerance per parameter element (None: ``tolerances_for(precision)``).
        timeout_s: Process-group timeout of the distributed run.
        device: Device of the distributed run (``cpu``, ``cuda`` or ``auto``); the reference
            runs on the CPU.
        **optim: The other optimisation fields of :class:`TrainConfig` for both runs
            (``weight_decay``, ``momentum``, ``betas``, ``eps``, ``lr_schedule``,
            ``warmup_steps``, ``min_lr``, ``clip_grad_norm``).
        data: Training samples both runs take their batches from (see :func:`reference_run`);
            None: ``make_batch``.
        precision: ``fp32`` or ``bf16`` (:mod:`dapple.runtime.precision`), both runs.

    Raises:
        ValidationError: A plan does not fit its workload, or bad options.
        RankFailure: A worker failed.
    """
    check_verify_precision(precision, device)
    rtol = tolerances_for(precision)[0] if rtol is None else rtol
    atol = tolerances_for(precision)[1] if atol is None else atol
    if not cases:
        raise ValidationError("verify needs at least one (plan, workload) case")
    if rtol < 0 or atol < 0:
        raise ValidationError(f"tolerances must be >= 0, got rtol={rtol} atol={atol}")
    cfg = replace(
        _config(steps, seed, optimizer, lr, optim),
        timeout_s=timeout_s,
        device=device,
        precision=precision,
    )
    for plan, wl in cases:
        validate_run(plan, wl, len(plan.devices), zero_stage=cfg.zero_stage)
        check_data(wl, data, plan.global_batch_size, seed)
        if data is None:  # every step's batch fits the model (shapes that change per step)
            check_steps(wl, plan.global_batch_size, seed, steps)
    world = max(len(plan.devices) for plan, _ in cases)
    refs: dict[tuple[int, int], _Reference] = {}
    for plan, wl in cases:
        key = (id(wl), plan.global_batch_size)
        if key not in refs:
            refs[key] = _reference(wl, plan.global_batch_size, cfg, data)
    with tempfile.TemporaryDirectory(prefix="dapple-verify-") as tmp:
        payload = [(plan.to_dict(), wl) for plan, wl in cases]
        spawn(_worker, world, payload, cfg, tmp, data, timeout_s=timeout_s)
        reports = []
        for c, (plan, wl) in enumerate(cases):
            runs = [
                torch.load(Path(tmp, f"case{c}-rank{r}.pt"), weights_only=True)
                for r in plan.devices
            ]
            losses, norms = json.loads(Path(tmp, f"case{c}-losses.json").read_text())
            ref = refs[(id(wl), plan.global_batch_size)]
            reports.append(
                VerifyReport(
                    plan=plan,
                    model_name=wl.name,
                    reference=ref.kind,
                    stages=_stage_diffs(plan, ref.params, runs, rtol, atol),
                    losses=tuple(float(x) for x in losses),
                    reference_losses=tuple(ref.losses),
                    rtol=rtol,
                    atol=atol,
                    options={"steps": steps, "seed": seed, "optimizer": optimizer, "lr": lr}
                    | {"precision": precision}
                    | optim,
                    grad_norms=tuple(float("nan") if x is None else float(x) for x in norms),
                    reference_grad_norms=tuple(ref.grad_norms),
                    grad_norm_rtol=max(GRAD_NORM_RTOL, tolerances_for(precision)[0]),
                )
            )
    for rep in reports:
        log.info(
            "verify %s %s: max abs diff %.3g, %s",
            rep.model_name,
            rep.plan.replication,
            rep.max_abs_diff,
            "ok" if rep.ok else "MISMATCH",
        )
    return reports


def verify(plan: Plan, workload: Workload, steps: int = 2, **options: Any) -> VerifyReport:
    """Train ``plan`` distributed and in one process from the same seed; compare the results.

    Args:
        plan: The plan (one local process per plan device is started).
        workload: The model, data and loss (must pickle, see :func:`verify_many`).
        steps: Optimizer steps.
        **options: ``seed``, ``optimizer``, ``lr``, ``rtol``, ``atol``, ``timeout_s``,
            ``device``, ``data``, ``precision`` and the optimisation options as in
            :func:`verify_many`.

    Returns:
        Per-stage parameter differences after ``steps`` steps and the losses of both runs.

    Raises:
        ValidationError: The plan does not fit the workload, or bad options.
        RankFailure: A worker failed.
    """
    return verify_many([(plan, workload)], steps, **options)[0]
