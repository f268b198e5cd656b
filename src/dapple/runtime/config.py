"""Runtime configuration and per-step metrics records."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dapple.core.precision import TRAINING_PRECISIONS
from dapple.errors import ValidationError
from dapple.runtime.optim_config import OPTIMIZER_STATE_FACTOR, OPTIMIZERS, check_optim

__all__ = ["OPTIMIZERS", "OPTIMIZER_STATE_FACTOR", "StepMetrics", "TrainConfig"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"  # pragma: no cover


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """How to run a plan: steps, seed, optimizer, limits and reporting."""

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
    recompute: bool = False
    """Force re-computation on every stage (otherwise per stage from ``StagePlan.recompute``)."""
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
    file and :func:`dapple.api.train` keep 3 unless told (:class:`~dapple.runtime.run_config.
    RunOptions`)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``checkpoint_dir``, saved under any plan."""
    overwrite_checkpoints: bool = False
    """Start from step 0 in a ``checkpoint_dir`` that holds checkpoints (refused otherwise): they
    are deleted at this run's first save."""
    on_nonfinite: str = "stop"
    """Non-finite loss or gradient: ``stop`` (exit non-zero, weights untouched) or ``skip`` the step."""

    # -- evaluation and what a run shows (dapple.runtime.evaluate, dapple.runtime.reporting) --
    eval_every: int = 0
    """Evaluate after every N steps and after the last one (0: never): the mean loss over
    ``eval_batches`` fixed global batches, forward only through the pipeline."""
    eval_batches: int = 4
    """K, the global batches of each evaluation (the front doors: as many as the evaluation
    data holds when fewer, :func:`~dapple.runtime.run_config.resolve_eval`)."""
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
    zero_stage: int = 0
    """0: every replica of a stage keeps the whole optimizer state; 1: each replica of a stage
    with ``r_s > 1`` keeps and updates ``1/r_s`` of it (gradients reduce-scattered, updated
    parameters all-gathered in the stage); 2: the accumulated gradients are sharded too
    (:mod:`dapple.runtime.parallel.zero`); a no-op on stages with one replica."""

    def __post_init__(self) -> None:
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
    if c.on_nonfinite not in ("stop", "skip"):
        raise ValidationError(f"on_nonfinite must be stop or skip, got {c.on_nonfinite!r}")
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


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One training step as seen from rank 0."""

    step: int
    loss: float
    """Mean loss over the global batch (summed from the last stage's slices)."""
    step_ms: float
    """Wall time per step: rank 0's time from the previous step's collective to this step's
    (the first step of a run: from its start), where every rank meets (see
    :mod:`dapple.runtime.engine`)."""
    samples_per_s: float
    """Global batch over ``step_ms``."""
    peak_memory_bytes: tuple[int, ...]
    """Per stage, max over its replicas (CUDA: over the same period as ``step_ms``); with
    interleaving per device group (all its chunks)."""
    memory_kind: str
    """``cuda_max_allocated`` or ``held_activations`` (CPU, see :mod:`dapple.runtime.memory`)."""
    predicted_step_ms: float | None = None
    peak_resident_bytes: tuple[int, ...] = ()
    """Per stage, max over its replicas: the process's peak resident memory so far (CPU:
    ``VmHWM``; CUDA: ``max_memory_reserved`` over the same period as ``step_ms``)."""
    stage_resident_bytes: tuple[int, ...] = ()
    """Per stage, max over its replicas: ``peak_resident_bytes`` less the resident memory before
    the rank built its stage - what the stage's weights, gradients, optimizer state and
    activations added (the planner's per-replica estimate models this)."""
    resident_kind: str = ""
    """``VmHWM`` or ``cuda_max_reserved`` (empty: not measured)."""
    lr: float | None = None
    """The learning rate the step's optimizer update used (None: no update ran)."""
    grad_norm: float | None = None
    """The global gradient norm of the whole model before clipping (None: not computed)."""
    eval_loss: float | None = None
    """Mean validation loss measured after this step (None: no evaluation this step)."""
    tokens_per_s: float | None = None
    """Target tokens of the global batch over ``step_ms`` (None: not a token workload)."""
    tokens: int | None = None
    """Target tokens of the step's global batch; changes from step to step with the sequence
    length (None: not a token workload)."""
    expert_layers: tuple[int, ...] = ()
    """The layer of each MoE layer counted (model order; empty: the model has none the runtime
    counts, :mod:`dapple.runtime.parallel.expert.load`)."""
    expert_load: tuple[tuple[int, ...], ...] = ()
    """Per MoE layer, the token rows its router sent to each expert in this step, summed over
    the replicas (a token counts once per chosen expert: a layer's loads sum to tokens x top-k)."""
    expert_imbalance: tuple[float, ...] = ()
    """Per MoE layer, max/mean of its expert load (1: balanced; E: one expert got every row)."""
    expert_aux_loss: tuple[float | None, ...] = ()
    """Per MoE layer, its load-balancing loss ``E * sum_i f_i * P_i`` over the step's tokens (k:
    balanced; None: its router's probabilities not found)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        mem = " ".join(f"s{i}={_human(b)}" for i, b in enumerate(self.peak_memory_bytes))
        pred = (
            f" (predicted {self.predicted_step_ms:.1f} ms)"
            if self.predicted_step_ms is not None
            else ""
        )
        resident = " ".join(f"s{i}={_human(b)}" for i, b in enumerate(self.peak_resident_bytes))
        resident = f" peak[{self.resident_kind}] {resident}" if resident else ""
        opt = f" lr {self.lr:.3g}" if self.lr is not None else ""
        opt += f" grad_norm {self.grad_norm:.4g}" if self.grad_norm is not None else ""
        ev = f" eval_loss {self.eval_loss:.6f}" if self.eval_loss is not None else ""
        tok = f" {self.tokens} tokens" if self.tokens is not None else ""
        tok += f" {self.tokens_per_s:.0f} tokens/s" if self.tokens_per_s is not None else ""
        if self.expert_imbalance:  # the worst MoE layer
            worst = max(range(len(self.expert_imbalance)), key=self.expert_imbalance.__getitem__)
            tok += (f" expert max/mean {self.expert_imbalance[worst]:.2f} (layer "
                    f"{self.expert_layers[worst]}, worst of {len(self.expert_imbalance)})")  # fmt: skip
        return (
            f"step {self.step} loss {self.loss:.6f}{opt}{ev} time {self.step_ms:.1f} ms{pred} "
            f"{self.samples_per_s:.1f} samples/s{tok} peak[{self.memory_kind}] {mem}{resident}"
        )
