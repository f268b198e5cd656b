"""What rank 0 shows of a run beside its per-step line: a progress bar, TensorBoard scalars and
the loss curve.

- :class:`ProgressBar`: a ``rich`` progress bar with ETA (the mean step so far, moving with the
  clock) and the last loss, only when stdout is a terminal (never in pipes, logs or tests);
  the per-step lines print above it;
- :class:`TensorBoardWriter`: the step's scalars (loss, lr, grad norm, eval loss, tokens/s,
  samples/s, step ms) through ``torch.utils.tensorboard.SummaryWriter`` (needs the
  ``tensorboard`` package, checked by :class:`~dapple.runtime.train_config.TrainConfig`);
- :func:`write_loss_curve`: a PNG of the train loss per step and the eval loss points
  (matplotlib, Agg backend).

Both reporters are :class:`~dapple.runtime.metrics.MetricsSink` callbacks with a ``close``;
:func:`open_reporters` builds the ones a :class:`~dapple.runtime.train_config.TrainConfig` asks for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dapple.datasets import IGNORE_INDEX
from dapple.files.output_path import make_parent_dirs
from dapple.runtime.step_metrics import StepMetrics
from dapple.runtime.train_config import TrainConfig

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "ProgressBar",
    "Reporter",
    "TensorBoardWriter",
    "eta_text",
    "open_reporters",
    "scalars",
    "target_token_count",
    "target_tokens",
    "write_loss_curve",
]


class Reporter(Protocol):
    """A per-step callback that holds something to close at the end of the run."""

    def __call__(self, m: StepMetrics) -> None: ...
    def close(self) -> None: ...


def target_tokens(targets: torch.Tensor) -> int | None:
    """Tokens in a global batch: the targets that are integer token ids (an integer tensor with
    a sequence dimension), padding (``-100``, the ignore index) left out; None otherwise
    (regression targets, one class label per sample)."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dim() < 2:
        return None
    return int((targets != IGNORE_INDEX).sum())


def target_token_count(targets: torch.Tensor) -> torch.Tensor | None:
    """:func:`target_tokens` as a 0-d int64 tensor where ``targets`` live, not read on the host
    (``count_nonzero``: no float conversion; the step's row converts it as it copies it in);
    None: not a token workload (known from the dtype and shape alone)."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dim() < 2:
        return None
    return torch.count_nonzero(targets != IGNORE_INDEX)


def eta_text(elapsed_s: float | None, done: int, left: int) -> str:
    """The time left at the mean time per step so far, the time since the last step included
    (so it moves with the clock: up while a step runs long, down as steps end): ``0:01:05``;
    ``-:--:--`` before the first step.

    Args:
        elapsed_s: seconds since the bar started (None: not started).
        done: steps ended since then.
        left: steps still to run.
    """
    if elapsed_s is None or done <= 0:
        return "-:--:--"
    minutes, seconds = divmod(int(elapsed_s / done * max(left, 0)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{seconds:02d}"


class ProgressBar:
    """A ``rich`` progress bar over the run's steps: done/total, elapsed, ETA (:func:`eta_text`,
    redrawn with the clock) and the last loss."""

    def __init__(
        self,
        total: int,
        start: int = 0,
        *,
        console: Console | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """Args:
        total: the run's steps.
        start: steps already done (a resumed run; the ETA counts only the steps run since).
        console: where to draw (default: stdout).
        clock: seconds, monotonic (default: rich's; tests pass a fake one).
        """
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.text import Text

        class _Eta(ProgressColumn):
            def render(self, task: Any) -> Text:
                left = int(task.total or 0) - int(task.completed)
                return Text(eta_text(task.elapsed, int(task.completed) - start, left))

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            _Eta(),
            TextColumn("{task.fields[status]}"),
            console=console,
            redirect_stdout=True,  # the per-step lines print above the bar
            get_time=clock,
        )
        self._task = self._progress.add_task("train", total=total, completed=start, status="")
        self._progress.start()

    def __call__(self, m: StepMetrics) -> None:
        status = f"loss {m.loss:.4f}"
        if m.eval_loss is not None:
            status += f" eval {m.eval_loss:.4f}"
        self._progress.update(self._task, completed=m.step + 1, status=status)
        self._progress.refresh()  # steps may be shorter than the bar's refresh period

    def close(self) -> None:
        self._progress.stop()


def scalars(m: StepMetrics) -> dict[str, float]:
    """The step's scalars under their TensorBoard tags (fields that are None are left out; an
    MoE model's expert max/mean load and load-balancing loss per layer under
    ``moe/max_over_mean/layer_<i>`` and ``moe/aux_loss/layer_<i>``)."""
    values: dict[str, float | None] = {
        "train/loss": m.loss,
        "train/lr": m.lr,
        "train/grad_norm": m.grad_norm,
        "eval/loss": m.eval_loss,
        "perf/tokens_per_s": m.tokens_per_s,
        "perf/samples_per_s": m.samples_per_s,
        "perf/step_ms": m.step_ms,
    }
    for layer, ratio in zip(m.expert_layers, m.expert_imbalance, strict=True):
        values[f"moe/max_over_mean/layer_{layer}"] = ratio
    for layer, aux in zip(m.expert_layers, m.expert_aux_loss, strict=True):
        values[f"moe/aux_loss/layer_{layer}"] = aux
    return {k: float(v) for k, v in values.items() if v is not None}


class TensorBoardWriter:
    """Writes :func:`scalars` of every step to a TensorBoard log directory."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=log_dir)

    def __call__(self, m: StepMetrics) -> None:
        for tag, value in scalars(m).items():
            self._writer.add_scalar(tag, value, global_step=m.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_reporters(config: TrainConfig, *, rank: int, start: int) -> list[Reporter]:
    """Rank 0's reporters of a run: the progress bar (``config.progress`` and stdout is a
    terminal) and the TensorBoard writer (``config.tensorboard_dir``); none on other ranks."""
    if rank != 0:
        return []
    out: list[Reporter] = []
    if config.tensorboard_dir is not None:
        out.append(TensorBoardWriter(config.tensorboard_dir))
    if config.progress and sys.stdout.isatty():
        out.append(ProgressBar(config.steps, start))
    return out


def write_loss_curve(metrics: Sequence[StepMetrics], path: str | Path) -> Path:
    """A PNG of the train loss per step (line) and the eval loss where measured (points).

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        ax.plot([m.step for m in metrics], [m.loss for m in metrics], label="train loss")
        evals: list[tuple[int, Any]] = [
            (m.step, m.eval_loss) for m in metrics if m.eval_loss is not None
        ]
        if evals:
            xs, ys = zip(*evals, strict=True)
            ax.plot(xs, ys, "o--", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(make_parent_dirs(path), dpi=100)
    finally:
        plt.close(fig)
    return path
