"""The distributed side of ``dapple verify`` and the step-by-step comparison (the method is in
:mod:`dapple.runtime.verify`)."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from dapple.core.plan import Plan
from dapple.core.precision import precision_of
from dapple.errors import DappleError, ValidationError
from dapple.models.shapes import check_steps
from dapple.models.workload import Workload
from dapple.runtime import init_distributed, run_plan, shutdown_distributed, spawn, validate_run
from dapple.runtime.data import check_data
from dapple.runtime.launch.refusal import hand_over, is_refusal
from dapple.runtime.precision import check_verify_precision, tolerances_for
from dapple.runtime.train_config import OPTIM_FIELDS, TrainConfig
from dapple.runtime.verify.reference import ForcedReference
from dapple.runtime.verify.report import (
    ATOL,
    GRAD_NORM_RTOL,
    GRAD_RTOL,
    RTOL,
    GradPiece,
    Params,
    StageDiff,
    VerifyReport,
    grad_diffs,
    merge,
    stage_diffs,
)

__all__ = [
    "PERTURBATION",
    "PERTURB_GRAD_RANK_ENV",
    "WORKER_SETUP_ENV",
    "verify",
    "verify_many",
]

log = logging.getLogger(__name__)

PERTURB_GRAD_RANK_ENV = "DAPPLE_TEST_PERTURB_GRAD_RANK"
"""Test hook: the rank whose gradients get ``PERTURBATION`` added (verification must fail)."""
PERTURBATION = 1e-2
WORKER_SETUP_ENV = "DAPPLE_TEST_VERIFY_SETUP"
"""Test hook: ``module:function`` each verify worker calls with its rank before training (to
inject a defect that verification must catch)."""


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


def perturbed(workload: Workload) -> Workload:
    """``workload`` whose layers add ``PERTURBATION`` to every gradient."""
    return replace(workload, layer_factories=[_Perturbed(f) for f in workload.layer_factories])


class _Recorder:
    """``run_plan``'s ``on_update``: this rank's weights and the gradients its optimizer is
    about to apply, at every step (on the CPU)."""

    def __init__(self, plan: Plan, rank: int, progress: str | None = None) -> None:
        self.plan, self.rank = plan, rank
        self.steps: dict[int, dict[str, Any]] = {}
        self.progress = progress
        """Rank 0: the run's name, said on stderr at each step (:func:`say`); None: silent."""

    def __call__(
        self, step: int, module: nn.Module, held: list[tuple[torch.Tensor, torch.Tensor, int]]
    ) -> None:
        names: dict[int, list[tuple[int, str]]] = {}
        weights: Params = {}
        layers = zip(self.plan.layers_of_device(self.rank), module.children(), strict=True)
        for i, layer in layers:
            weights[i] = {}
            for n, p in layer.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append((i, n))
                weights[i][n] = p.detach().cpu().clone()
        grads: list[GradPiece] = []
        for param, origin, offset in held:
            g = param.grad
            flat = torch.zeros(param.numel()) if g is None else g.detach().reshape(-1).cpu()
            for i, n in names[id(origin)]:
                grads.append((i, n, offset, flat.float().clone()))
        self.steps[step] = {"weights": weights, "grads": grads}
        if self.progress is not None:
            say(f"{self.progress}: step {step} done")


def say(line: str) -> None:
    """One progress line of ``dapple verify`` on stderr, as it happens (stdout keeps the
    report)."""
    print(f"verify: {line}", file=sys.stderr, flush=True)


def _die(msg: str) -> None:
    sys.stdout.flush()
    os.write(2, f"dapple: error: {msg}\n".encode())
    os._exit(1)


def _setup_hook(rank: int) -> None:
    spec = os.environ.get(WORKER_SETUP_ENV)
    if spec:
        module, _, fn = spec.partition(":")
        getattr(importlib.import_module(module), fn)(rank)


def _worker(
    rank: int,
    world: int,
    cases: list[tuple[dict[str, Any], Workload]],
    cfg: TrainConfig,
    out: str,
    data: Dataset[Any] | None = None,
    progress: bool = False,
) -> None:
    """One rank: run every case's plan in turn, recording each step's weights and gradients;
    write this rank's record after each case (with ``progress`` rank 0 says each step on
    stderr)."""
    try:
        device = init_distributed(cfg, world)
        _setup_hook(rank)
        perturb = rank == int(os.environ.get(PERTURB_GRAD_RANK_ENV, "-1"))
        for c, (plan_d, wl) in enumerate(cases):
            plan = Plan.from_dict(plan_d)
            name = f"the plan's run ({plan.replication}, {len(plan.devices)} processes)"
            recorder = _Recorder(plan, rank, name if progress and rank == 0 else None)
            run = run_plan(plan, perturbed(wl) if perturb else wl, cfg, device=device,
                           exact_world=False, data=data, on_update=recorder)  # fmt: skip
            if run.whole is not None:
                layers = run.whole
            elif run.module is not None and run.stage is not None:
                layers = {
                    i: {n: p.detach().cpu() for n, p in layer.named_parameters()}
                    for i, layer in zip(
                        plan.layers_of_device(rank), run.module.children(), strict=True
                    )
                }
            if run.module is not None and run.stage is not None:
                record = {"stages": list(plan.stages_of_device(rank)), "replica": run.replica,
                          "layers": layers, "steps": recorder.steps}  # fmt: skip
                torch.save(record, Path(out, f"case{c}-rank{rank}.pt"))
            if rank == 0:
                losses = [m.loss for m in run.metrics]
                norms = [m.grad_norm for m in run.metrics]
                Path(out, f"case{c}-losses.json").write_text(json.dumps([losses, norms]))
        shutdown_distributed()
    except Exception as e:
        if is_refusal(e):
            hand_over(e, rank)  # the launcher ends every worker and raises it
        _die(str(e) if isinstance(e, DappleError) else f"rank {rank}: {type(e).__name__}: {e}")


# ------------------------------------------------------------------------- the comparison
def _step_record(r: dict[str, Any], step: int) -> dict[str, Any]:
    if step not in r["steps"]:
        raise ValidationError(
            f"step {step}: stage(s) {r['stages']} replica {r['replica']} made no update "
            "(the distributed run skipped the step: non-finite gradients?)"
        )
    return cast(dict[str, Any], r["steps"][step])


def _weights_at(records: list[dict[str, Any]], step: int, steps: int) -> list[dict[str, Any]]:
    """Every rank's weights at the start of ``step`` (after the last: the final weights)."""
    return [
        {**r, "layers": r["layers"] if step == steps else _step_record(r, step)["weights"]}
        for r in records
    ]


def _grads_at(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """Every rank's gradients that its optimizer applied at ``step``."""
    return [{**r, "grads": _step_record(r, step)["grads"]} for r in records]


def _replica0_weights(records: list[dict[str, Any]], step: int) -> Params:
    """Every layer's weights at ``step`` as replica 0 of its stage holds them."""
    out: Params = {}
    for r in records:
        if r["replica"] == 0:
            out.update(_step_record(r, step)["weights"])
    return out


def _whole_grads(records: list[dict[str, Any]], step: int, like: Params) -> Params:
    """Every parameter's gradient at ``step``, assembled from what each rank's optimizer
    applies (replica 0's where replicas overlap; ZeRO pieces from their owners).

    Raises:
        ValidationError: no rank updates some element of a parameter.
    """
    flat = {(i, n): torch.zeros(t.numel()) for i, layer in like.items() for n, t in layer.items()}
    seen = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in flat.items()}
    for r in sorted(records, key=lambda r: -int(r["replica"])):  # replica 0 written last
        for i, n, offset, g in _step_record(r, step)["grads"]:
            flat[(i, n)][offset : offset + g.numel()] = g
            seen[(i, n)][offset : offset + g.numel()] = True
    for (i, n), s in seen.items():
        if not bool(s.all()):
            raise ValidationError(
                f"step {step}: no rank updated {int((~s).sum())} elements of layer {i} {n!r}"
            )
    return {i: {n: flat[(i, n)].view_as(t) for n, t in layer.items()} for i, layer in like.items()}


def _compare(
    plan: Plan,
    ref: ForcedReference,
    records: list[dict[str, Any]],
    steps: int,
    tol: dict[str, float],
    progress: bool = False,
) -> tuple[tuple[StageDiff, ...], list[float], list[float]]:
    """Step by step (:class:`ForcedReference`): the initial weights, then each step's
    gradients on the same weights and weights after the same update (with ``progress`` each
    step said on stderr)."""
    rtol, atol = tol["rtol"], tol["atol"]
    diffs = stage_diffs(plan, ref.initial, _weights_at(records, 0, steps), rtol, atol, "initial ")
    losses, norms = [], []
    for t in range(steps):
        if progress:
            say(f"the single-device reference ({ref.kind}): step {t} of {steps}, comparing")
        res = ref.step(t, _replica0_weights(records, t), _whole_grads(records, t, ref.initial))
        grads = grad_diffs(plan, res.grads, _grads_at(records, t), tol["grad_rtol"], f"step {t} ")
        after = stage_diffs(plan, res.expected, _weights_at(records, t + 1, steps), rtol, atol,
                            f"step {t} ")  # fmt: skip
        diffs = tuple(merge(merge(d, g), w) for d, g, w in zip(diffs, grads, after, strict=True))
        losses.append(res.loss)
        norms.append(res.grad_norm)
    return diffs, losses, norms


def verify_many(
    cases: Sequence[tuple[Plan, Workload]],
    config: TrainConfig,
    *,
    data: Dataset[Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    grad_rtol: float | None = None,
    progress: bool = True,
) -> list[VerifyReport]:
    """:func:`verify` several ``(plan, workload)`` pairs with ONE launch of worker processes.

    ``max(len(plan.devices))`` processes start once and run the plans one after the other;
    the single-process references run here, one per case, step by step along its run.

    Args:
        cases: Plans and the workloads they train (workloads must pickle: spec-loaded ones from
            :func:`dapple.api.load` or ``dapple.models.hf`` do).
        config: Both runs' options, resolved: ``steps``, ``seed`` (weights; step ``t`` uses
            batch seed ``seed + t``), ``optimizer``, ``lr``, the other optimisation fields
            (:data:`~dapple.runtime.train_config.OPTIM_FIELDS`), ``precision`` (``fp32`` or
            ``bf16``, :mod:`dapple.runtime.precision`), ``device`` of the distributed run (the
            reference runs on the CPU) and ``timeout_s`` (its process-group timeout).
        data: Training samples both runs take their batches from (see
            :func:`~dapple.runtime.verify.reference_run`); None: ``make_batch``.
        rtol: Relative tolerance of each weight after an update from the same gradients
            (default :data:`RTOL`).
        atol: Absolute tolerance of each weight after such an update (default :data:`ATOL`).
        grad_rtol: Tolerance of each gradient element as a fraction of its layer's largest
            (default :data:`GRAD_RTOL`; bf16: ``tolerances_for("bf16")``'s rtol).
        progress: Say on stderr, as it goes, which run is going: the plan's (each step, from
            rank 0), then the single-device reference and the comparison (each step).

    Raises:
        ValidationError: A plan does not fit its workload, or bad options.
        RankFailure: A worker failed.
    """
    check_verify_precision(config.precision, config.device)
    tol = _tolerances(config.precision, rtol, atol, grad_rtol)
    if not cases:
        raise ValidationError("verify needs at least one (plan, workload) case")
    bad = {k: v for k, v in tol.items() if not (math.isfinite(v) and v >= 0)}
    if bad:
        raise ValidationError(f"tolerances must be finite numbers >= 0, got {bad}")
    for plan, wl in cases:
        validate_run(plan, wl, len(plan.devices), zero_stage=config.zero_stage)
        check_data(wl, data, plan.global_batch_size, config.seed)
        if data is None:  # every step's batch fits the model (shapes that change per step)
            check_steps(wl, plan.global_batch_size, config.seed, config.steps)
    world = max(len(plan.devices) for plan, _ in cases)
    with tempfile.TemporaryDirectory(prefix="dapple-verify-") as tmp:
        payload = [(plan.to_dict(), wl) for plan, wl in cases]
        if progress:
            say(f"starting {world} process{'es' * (world != 1)} for the plan's run"
                + (f" ({len(cases)} plans in turn)" if len(cases) > 1 else ""))  # fmt: skip
        spawn(_worker, world, payload, config, tmp, data, progress, timeout_s=config.timeout_s,
              closing=partial(_stopped, tmp))  # fmt: skip
        reports = [
            _report(Path(tmp), c, plan, wl, config, data, tol, progress)
            for c, (plan, wl) in enumerate(cases)
        ]
    if progress:
        say("done")
    for rep in reports:
        log.info("verify %s %s: gradients %.3g of scale, weights %.3g, %s", rep.model_name,
                 rep.plan.replication, rep.max_grad_diff, rep.max_abs_diff,
                 "ok" if rep.ok else "MISMATCH")  # fmt: skip
    return reports


def _stopped(tmp: str, name: str) -> str:
    """The closing line of a verify a signal stopped; removes its temporary folder first (the
    signal ends this process inside the ``with`` block that would)."""
    shutil.rmtree(tmp, ignore_errors=True)
    return f"dapple: verify stopped by {name}; nothing verified"


def _options(cfg: TrainConfig) -> dict[str, Any]:
    """What a report says both runs trained with: steps, seed, optimizer, learning rate,
    precision and the other optimisation options."""
    named = ("steps", "seed", "optimizer", "lr", "precision", *OPTIM_FIELDS)
    return {n: getattr(cfg, n) for n in named}


def _tolerances(
    precision: str, rtol: float | None, atol: float | None, grad_rtol: float | None
) -> dict[str, float]:
    """The weights' ``rtol`` and ``atol`` and the gradients' ``grad_rtol``: the given ones, or
    the defaults (:data:`RTOL`, :data:`ATOL`, :data:`GRAD_RTOL`; low precision: its rtol for
    the gradients)."""
    low = precision_of(precision).autocast
    default_grad = tolerances_for(precision)[0] if low else GRAD_RTOL
    return {
        "rtol": RTOL if rtol is None else rtol,
        "atol": ATOL if atol is None else atol,
        "grad_rtol": default_grad if grad_rtol is None else grad_rtol,
    }


def _report(
    tmp: Path,
    c: int,
    plan: Plan,
    wl: Workload,
    cfg: TrainConfig,
    data: Dataset[Any] | None,
    tol: dict[str, float],
    progress: bool = False,
) -> VerifyReport:
    """Case ``c``'s report: its workers' records in ``tmp`` against its single-process
    reference, step by step (:func:`_compare`)."""
    records = [torch.load(tmp / f"case{c}-rank{r}.pt", weights_only=True) for r in plan.devices]
    losses, norms = json.loads((tmp / f"case{c}-losses.json").read_text())
    ref = ForcedReference(wl, plan.global_batch_size, cfg, data)
    diffs, ref_losses, ref_norms = _compare(plan, ref, records, cfg.steps, tol, progress)
    low = precision_of(cfg.precision).autocast
    norm_rtol = max(GRAD_NORM_RTOL, tolerances_for(cfg.precision)[0]) if low else GRAD_NORM_RTOL
    return VerifyReport(
        plan=plan,
        model_name=wl.name,
        reference=ref.kind,
        stages=diffs,
        losses=tuple(float(x) for x in losses),
        reference_losses=tuple(ref_losses),
        rtol=tol["rtol"],
        atol=tol["atol"],
        options=_options(cfg),
        grad_norms=tuple(float("nan") if x is None else float(x) for x in norms),
        reference_grad_norms=tuple(ref_norms),
        grad_norm_rtol=norm_rtol,
        grad_rtol=tol["grad_rtol"],
    )


def verify(plan: Plan, workload: Workload, config: TrainConfig, **checks: Any) -> VerifyReport:
    """Train ``plan`` distributed and check it step by step against one process.

    Args:
        plan: The plan (one local process per plan device is started).
        workload: The model, data and loss (must pickle, see :func:`verify_many`).
        config: Both runs' options, resolved (as in :func:`verify_many`).
        **checks: ``data``, ``rtol``, ``atol``, ``grad_rtol`` and ``progress`` as in
            :func:`verify_many`.

    Returns:
        Per-stage differences of gradients and weights, and both runs' losses and norms.

    Raises:
        ValidationError: The plan does not fit the workload, or bad options.
        RankFailure: A worker failed.
    """
    return verify_many([(plan, workload)], config, **checks)[0]
