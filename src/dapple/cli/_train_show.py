"""``dapple train``'s evaluation and reporting flags and its final summary.

Flags: ``--eval-every N``, ``--eval-batches K`` and ``--eval-batch-size G_E`` (forward-only evaluation through the
pipeline, :mod:`dapple.runtime.evaluate`), ``--grad-norm-every N`` (the gradient norm on every Nth
step), ``--tensorboard DIR`` and ``--loss-curve PATH``.
The run always asks for a progress bar; rank 0 shows it only when stdout is a terminal.

The summary (rank 0, after the run): the final train loss, the last validation loss and the
loss-curve PNG, written to ``--loss-curve`` or by default beside the ``--metrics`` file
(``m.jsonl`` -> ``m.loss.png``); without either no curve is written (a run does not litter the
current directory).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free import of the CLI
    from dapple.runtime.step_metrics import StepMetrics

__all__ = [
    "DEFAULT_EVAL_BATCHES",
    "add_show_arguments",
    "loss_curve_path",
    "print_summary",
]

DEFAULT_EVAL_BATCHES = 4
"""K when ``--eval-batches`` is not given (fewer when ``--eval-data`` holds fewer batches)."""


def add_show_arguments(p: argparse.ArgumentParser) -> None:
    """Add the evaluation and reporting flags to ``dapple train``'s parser."""
    g = p.add_argument_group("evaluation and reporting")
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate forward-only through the pipeline after every N steps and after the "
        "last one (default 0: never)",
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        metavar="K",
        help=f"global batches per evaluation, the same fixed set every time (default "
        f"{DEFAULT_EVAL_BATCHES}, or as many as --eval-data holds if fewer)",
    )
    g.add_argument(
        "--eval-batch-size",
        type=int,
        default=None,
        metavar="G_E",
        help="samples per eval batch (default: the plan's global batch); the same stages and "
        "replicas evaluate it, in the most micro-batches <= M that divide it",
    )
    g.add_argument(
        "--grad-norm-every",
        type=int,
        default=1,
        metavar="N",
        help="compute and report the global gradient norm on steps 0, N, 2N, ... only; the "
        "other steps check the gradients' finiteness for --on-nonfinite in one fused op "
        "(default 1: every step; refused above 1 with --clip-grad-norm)",
    )
    g.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write per-step scalars for TensorBoard here (needs the tensorboard package)",
    )
    g.add_argument(
        "--loss-curve",
        default=None,
        metavar="PATH",
        help="write the loss-curve PNG here (default: beside --metrics, as NAME.loss.png)",
    )


def loss_curve_path(loss_curve: str | None, metrics_path: str | None) -> Path | None:
    """Where the loss curve goes: ``loss_curve``, else beside ``metrics_path`` (None:
    nowhere); ``dapple train`` checks it can be written
    (:func:`dapple.files.output_path.check_picture_file`) before the run starts."""
    if loss_curve is not None:
        return Path(loss_curve)
    if metrics_path is not None:
        return Path(metrics_path).with_suffix(".loss.png")
    return None


def print_summary(metrics: Sequence[StepMetrics], curve: Path | None) -> None:
    """Rank 0 after the run: final train loss, last validation loss, the loss-curve PNG."""
    if not metrics:
        return
    print(f"final train loss {metrics[-1].loss:.6f} (step {metrics[-1].step})")
    evals = [m for m in metrics if m.eval_loss is not None]
    if evals:
        print(f"last validation loss {evals[-1].eval_loss:.6f} (after step {evals[-1].step})")
    if curve is not None:
        from dapple.runtime.reporting import write_loss_curve

        print(f"loss curve written to {write_loss_curve(metrics, curve)}")
