"""What the runtime is asked to do with a plan: :class:`TrainConfig` - steps, seed, the
optimizer and its options, limits, checkpoints and reporting.

This is the part of a run's request the runtime reads: :func:`dapple.runtime.train`, the
launcher, the elastic loop and every worker get a :class:`TrainConfig` (beside the plan, the
built workload and the data, and an elastic run's policy), each value already resolved. The
request a front door takes (``dapple train``, a run file, :func:`dapple.api.train`) is
:class:`dapple.api.run_config.RunConfig`, which holds one of these beside the model, the plan
file, the data and the options only a front door resolves (``keep = 0``, an unset
``eval_batches``, the prediction's profile). The two stay apart because that request names
files and choices the workers never see, and a :class:`TrainConfig` must not carry values
still to be resolved.

Torch-free (the CLI reads :data:`LR_SCHEDULES` and :data:`OPTIMIZERS` for its choices); the
optimizers, the learning-rate schedule and the clipping themselves are in
:mod:`dapple.runtime.optim`. ``TrainConfig.zero_stage`` takes
:data:`dapple.core.parallelism.ZERO_STAGES`.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Protocol

from dapple.core.parallelism import ZERO_STAGES
from dapple.core.planning_options import NONFINITE_MODES
from dapple.core.precision import TRAINING_PRECISIONS, precision_of
from dapple.core.recompute import Recompute, recompute_of
from dapple.errors import ValidationError, check_integer_fields

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "OPTIMIZER_STATE_FACTOR",
    "OPTIM_FIELDS",
    "OptimOptions",
    "TrainConfig",
    "check_optim",
    "state_factor",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
"""``TrainConfig.optimizer`` values (:func:`dapple.runtime.optim.make_optimizer`)."""

OPTIMIZER_STATE_FACTOR = {"sgd": 1.0, "adam": 3.0, "adamw": 3.0}
"""Bytes of gradients and optimizer state per parameter byte: SGD keeps the gradient (plus a
momentum buffer when ``momentum > 0``, not counted here), Adam and AdamW the gradient and two
moments (the profile's ``optimizer_state_factor`` for the planner)."""

LR_SCHEDULES = ("constant", "cosine")
"""``constant``: linear warm-up, then ``lr``; ``cosine``: linear warm-up, then cosine decay to
``min_lr`` at the last step (:func:`dapple.runtime.optim.lr_at`)."""

OPTIM_FIELDS = (
    "weight_decay",
    "momentum",
    "betas",
    "eps",
    "lr_schedule",
    "warmup_steps",
    "min_lr",
    "clip_grad_norm",
    "zero_stage",
)
"""The :class:`TrainConfig` fields of the optimisation options besides ``optimizer`` and
``lr`` (what ``verify`` forwards to both of its runs)."""


class OptimOptions(Protocol):
    """The optimisation fields of :class:`~dapple.runtime.train_config.TrainConfig`."""

    @property
    def optimizer(self) -> str: ...
    @property
    def lr(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def momentum(self) -> float: ...
    @property
    def betas(self) -> tuple[float, float]: ...
    @property
    def eps(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def min_lr(self) -> float: ...
    @property
    def clip_grad_norm(self) -> float | None: ...
    @property
    def zero_stage(self) -> int: ...


def check_optim(c: OptimOptions) -> None:
    """Validate the optimisation options of ``c``.

    Raises:
        ValidationError: the first bad value, named with the option.
    """
    if not (c.weight_decay >= 0 and math.isfinite(c.weight_decay)):
        raise ValidationError(f"weight_decay must be a finite number >= 0, got {c.weight_decay}")
    if not (0 <= c.momentum < 1):
        raise ValidationError(f"momentum must be in [0, 1), got {c.momentum}")
    if c.momentum and c.optimizer != "sgd":
        raise ValidationError(
            f"momentum applies to the sgd optimizer only, got momentum={c.momentum} with "
            f"optimizer {c.optimizer!r} (adam/adamw: use betas)"
        )
    if len(c.betas) != 2 or not all(0 <= b < 1 for b in c.betas):
        raise ValidationError(f"betas must be two numbers in [0, 1), got {c.betas}")
    if not (c.eps > 0 and math.isfinite(c.eps)):
        raise ValidationError(f"eps must be a finite number > 0, got {c.eps}")
    if c.lr_schedule not in LR_SCHEDULES:
        raise ValidationError(
            f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {c.lr_schedule!r}"
        )
    if c.warmup_steps < 0:
        raise ValidationError(f"warmup_steps must be >= 0, got {c.warmup_steps}")
    if not (0 <= c.min_lr <= c.lr):
        raise ValidationError(f"min_lr must be in [0, lr={c.lr}], got {c.min_lr}")
    if c.min_lr and c.lr_schedule != "cosine":
        raise ValidationError(
            f"min_lr={c.min_lr} applies to the cosine schedule only, got lr_schedule "
            f"{c.lr_schedule!r}"
        )
    if c.zero_stage not in ZERO_STAGES:
        raise ValidationError(
            f"zero_stage must be one of {', '.join(map(str, ZERO_STAGES))}, got {c.zero_stage!r}"
        )
    clip = c.clip_grad_norm
    if clip is not None and not (clip > 0 and math.isfinite(clip)):
        raise ValidationError(f"clip_grad_norm must be a finite number > 0, got {clip}")


def state_factor(optimizer: str, momentum: float = 0.0) -> float:
    """Bytes of gradients and optimizer state per parameter byte (the planner's
    ``optimizer_state_factor``): :data:`OPTIMIZER_STATE_FACTOR`, plus the momentum buffer of
    SGD with ``momentum > 0``."""
    extra = 1.0 if optimizer == "sgd" and momentum > 0 else 0.0
    return OPTIMIZER_STATE_FACTOR[optimizer] + extra


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """How the runtime runs a plan: steps, seed, optimizer, limits and reporting, resolved
    (a front door's request is :class:`~dapple.api.run_config.RunConfig`)."""

    steps: int = 1
    """Optimizer steps to run."""
    seed: int = 0
    """Initial weights use ``workload.build_stage(.., seed)``; step ``t`` uses batch seed ``seed + t``
    (with a dataset: the seed of its per-epoch shuffle, :mod:`dapple.datasets.sampler`)."""
    optimizer: str = "sgd"
    """``sgd``, ``adam`` or ``adamw`` (:func:`dapple.runtime.optim.make_optimizer`)."""
    lr: float = 0.01
    """Learning rate."""
    timeout_s: float = 300.0
    """Process-group timeout: a rank waiting longer on a peer fails with a one-line error."""
    recompute: Recompute | None = None
    """``full``: every stage re-computes its forward in the backward; ``none``: no stage does
    (:data:`~dapple.core.recompute.STAGE_RECOMPUTE`); None: each stage as its plan says
    (``StagePlan.recompute``)."""
    metrics_path: str | None = None
    """JSON-lines file rank 0 writes one :class:`StepMetrics` per step to."""
    echo: bool = False
    """Rank 0 prints one line per step to stdout."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``."""
    predicted_step_ms: float = math.nan
    """A prediction (simulator / cost model) printed beside the measured step time."""

    checkpoint_dir: str | None = None
    """Save checkpoints here and resume from them (:mod:`dapple.runtime.longrun`)."""
    save_every: int = 0
    """Save after every N completed steps and after the run's last step (0: never save)."""
    keep: int | None = None
    """Keep only the K newest complete checkpoints (None: keep all). ``dapple train``, a run
    file and :func:`dapple.api.train` keep 3 unless told (:class:`~dapple.api.run_config.
    RunOptions`)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``checkpoint_dir``, saved under any plan."""
    overwrite_checkpoints: bool = False
    """Start from step 0 in a ``checkpoint_dir`` that holds checkpoints (refused otherwise): they
    are deleted at this run's first save."""
    on_nonfinite: str = "stop"
    """Non-finite loss or gradient: ``stop`` (exit non-zero, weights untouched) or ``skip`` the
    step; ``off`` drops the guard: no rank waits for the others' verdict before its optimizer
    step, the step's metrics arrive a step late, and a non-finite step is applied (its loss and
    gradient norm show it). Refused with fp16 loss scaling and with ``clip_grad_norm`` (both
    need every rank's part before the update)."""

    # -- evaluation and what a run shows (dapple.runtime.evaluate, dapple.runtime.reporting) --
    eval_every: int = 0
    """Evaluate after every N steps and after the last one (0: never): the mean loss over
    ``eval_batches`` fixed global batches, forward only through the pipeline."""
    eval_batches: int = 4
    """K, the global batches of each evaluation (the front doors: as many as the evaluation
    data holds when fewer, :func:`~dapple.api.run_config.resolve_eval`)."""
    eval_batch_size: int | None = None
    """Samples per eval batch (None: the plan's global batch G). Another size runs the same
    stages and replicas with the micro-batching of :func:`dapple.runtime.evaluate.eval_plan`."""
    progress: bool = False
    """Rank 0 shows a progress bar with ETA (only when its stdout is a terminal)."""
    tensorboard_dir: str | None = None
    """Rank 0 writes the per-step scalars here for TensorBoard (needs ``tensorboard``)."""

    # -- mixed precision (dapple.runtime.precision) --
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16``: autocast dtype of every stage forward (weights and
    optimizer state stay fp32; fp16 adds dynamic loss scaling)."""

    # -- optimisation: optimizer options, lr schedule, gradient clipping (runtime/optim.py) ----
    weight_decay: float = 0.0
    """Weight decay of the parameters with ``ndim >= 2`` (biases and normalisation weights get
    none, :func:`dapple.runtime.optim.decays`); decoupled for ``adamw``, L2 for ``sgd``/``adam``."""
    momentum: float = 0.0
    """SGD momentum in ``[0, 1)`` (``sgd`` only)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW moment decay rates."""
    eps: float = 1e-8
    """Adam/AdamW denominator term."""
    lr_schedule: str = "constant"
    """``constant`` or ``cosine`` (:func:`dapple.runtime.optim.lr_at`; ``lr`` is the peak)."""
    warmup_steps: int = 0
    """Linear warm-up over the first N steps (both schedules)."""
    min_lr: float = 0.0
    """The cosine schedule's lr at the last step."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm of the whole model to this (None: no clipping; the norm is
    computed and reported either way)."""
    grad_norm_every: int = 1
    """Compute and report the global gradient norm (``StepMetrics.grad_norm``) on steps 0, N,
    2N, ... only (None on the others; 1: every step). On the other steps the non-finite
    guard's gradient verdict is one fused finiteness check of the same gradients instead of
    their norm (on the CPU the norm is one op per gradient, the check one op in all). Refused
    above 1 with ``clip_grad_norm``: clipping needs every step's norm."""
    zero_stage: int = 0
    """0: every replica of a stage keeps the whole optimizer state; 1: each replica of a stage
    with ``r_s > 1`` keeps and updates ``1/r_s`` of it (gradients reduce-scattered, updated
    parameters all-gathered in the stage); 2: the accumulated gradients are sharded too
    (:mod:`dapple.runtime.parallel.zero`); a no-op on stages with one replica."""

    def __post_init__(self) -> None:
        check_integer_fields(self)  # a float steps=1.5 failed in every worker
        if self.recompute is not None:
            object.__setattr__(self, "recompute", recompute_of(self.recompute, "recompute"))
        _check_long_run(self)
        _check_reporting(self)
        if self.steps < 1:
            raise ValidationError(f"steps must be >= 1, got {self.steps}")
        if self.steps > 2**63 - 1:  # else the seed's range below is empty: name the steps
            raise ValidationError(
                f"steps must be at most {2**63 - 1} (step t's batch seed seed + t is a 64-bit "
                f"torch seed), got {self.steps}"
            )
        if not -(2**63) <= self.seed <= 2**63 - 1 - self.steps:  # torch seeds are 64-bit
            raise ValidationError(
                f"seed must be an integer from {-(2**63)} to {2**63 - 1 - self.steps} (step t's "
                f"batch seed seed + t is a 64-bit torch seed), got {self.seed}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValidationError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if not (self.lr > 0):
            raise ValidationError(f"lr must be > 0, got {self.lr}")
        if not math.isfinite(self.lr):
            raise ValidationError(f"lr must be finite, got {self.lr}")
        if not (self.timeout_s > 0):
            raise ValidationError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValidationError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.precision not in TRAINING_PRECISIONS:
            raise ValidationError(
                f"precision must be one of {', '.join(TRAINING_PRECISIONS)}, got {self.precision!r}"
            )
        check_optim(self)


def _check_long_run(c: TrainConfig) -> None:
    """Validate the checkpoint and non-finite options."""
    if c.save_every < 0:
        raise ValidationError(f"save_every must be >= 0, got {c.save_every}")
    if c.keep is not None and c.keep < 1:
        raise ValidationError(f"keep must be >= 1, got {c.keep}")
    if c.on_nonfinite not in NONFINITE_MODES:
        raise ValidationError(
            f"on_nonfinite must be stop or skip (or off: no guard), got {c.on_nonfinite!r}"
        )
    # an unknown precision is refused by the later check, naming the training precisions
    scales = c.precision in TRAINING_PRECISIONS and precision_of(c.precision).loss_scaling
    if c.on_nonfinite == "off" and (scales or c.clip_grad_norm is not None):
        what = f"{c.precision} loss scaling" if scales else "clip_grad_norm"
        raise ValidationError(
            f"on_nonfinite off cannot go with {what}: it needs every rank's gradients before the "
            "optimizer step (use stop or skip)"
        )
    if c.grad_norm_every < 1:
        raise ValidationError(f"grad_norm_every must be >= 1, got {c.grad_norm_every}")
    if c.grad_norm_every > 1 and c.clip_grad_norm is not None:
        raise ValidationError(
            f"grad_norm_every {c.grad_norm_every} cannot go with clip_grad_norm "
            f"{c.clip_grad_norm}: clipping needs every step's gradient norm (use 1)"
        )
    if (c.save_every > 0 or c.resume) and c.checkpoint_dir is None:
        raise ValidationError("save_every and resume need a checkpoint_dir")
    if c.resume and c.overwrite_checkpoints:
        raise ValidationError(
            "resume keeps the checkpoints, overwrite_checkpoints deletes them: give one"
        )


def _check_reporting(c: TrainConfig) -> None:
    """Validate the evaluation and reporting options."""
    if c.eval_every < 0:
        raise ValidationError(f"eval_every must be >= 0, got {c.eval_every}")
    if c.eval_batches < 1:
        raise ValidationError(f"eval_batches must be >= 1, got {c.eval_batches}")
    if c.eval_batch_size is not None and c.eval_batch_size < 1:
        raise ValidationError(f"eval_batch_size must be >= 1, got {c.eval_batch_size}")
    if c.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ValidationError(
            f"tensorboard_dir {c.tensorboard_dir!r} needs the 'tensorboard' package "
            "(pip install tensorboard, or dapple[tensorboard])"
        )
