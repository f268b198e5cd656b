"""Names and checks of the optimisation options of :class:`~dapple.runtime.config.TrainConfig`.

Torch-free (the CLI reads :data:`LR_SCHEDULES` for its choices); the optimizers, the schedule
and the clipping themselves are in :mod:`dapple.runtime.optim`. Imports nothing of
:mod:`dapple.runtime.config` (which imports this module): :func:`check_optim` takes anything
with the option fields (:class:`OptimOptions`).
"""

from __future__ import annotations

import math
from typing import Protocol

from dapple.errors import ValidationError

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "OPTIMIZER_STATE_FACTOR",
    "OPTIM_FIELDS",
    "ZERO_STAGES",
    "OptimOptions",
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

ZERO_STAGES = (0, 1, 2, 3)
"""``TrainConfig.zero_stage`` values, a floor under each replicated stage's own
``StagePlan.zero_stage``: 0, every replica of a stage keeps the whole optimizer state; 1, each
of the ``r_s`` replicas keeps and updates its ``1/r_s`` shard of it; 2, the gradients are
sharded too (:mod:`dapple.runtime.parallel.zero`); 3, the parameters too (FSDP2,
:func:`dapple.runtime.parallel.stage_mesh.zero_floored`)."""

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
    """The optimisation fields of :class:`~dapple.runtime.config.TrainConfig`."""

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
