"""Optimisation flags of ``dapple train`` and ``dapple verify``: optimizer options, the lr
schedule and global gradient-norm clipping (the :class:`~dapple.runtime.TrainConfig` fields of
:data:`dapple.runtime.train_config.OPTIM_FIELDS`; ``--optimizer`` and ``--lr`` are in
:mod:`dapple.cli._run_args`). Torch-free at import time."""

from __future__ import annotations

import argparse

from dapple.errors import ValidationError

__all__ = ["LR_SCHEDULE_NAMES", "add_optim_arguments", "zero_stage_flag"]

LR_SCHEDULE_NAMES = ("constant", "cosine")
"""``--lr-schedule`` choices (:data:`dapple.runtime.train_config.LR_SCHEDULES`; a test keeps
the two equal without importing the runtime here)."""


def add_optim_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--weight-decay``, ``--momentum``, ``--betas``, ``--eps``, ``--lr-schedule``,
    ``--warmup-steps``, ``--min-lr``, ``--clip-grad-norm`` and ``--zero-stage`` to ``p``."""
    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        help="weight decay of parameters with ndim >= 2 (not biases or norm weights); "
        "decoupled for adamw (default %(default)s)",
    )
    g.add_argument(
        "--momentum", type=float, default=0.0, help="SGD momentum in [0, 1) (default %(default)s)"
    )
    g.add_argument(
        "--betas",
        type=float,
        nargs=2,
        default=(0.9, 0.999),
        metavar=("B1", "B2"),
        help="Adam/AdamW moment decay rates (default 0.9 0.999)",
    )
    g.add_argument("--eps", type=float, default=1e-8, help="Adam/AdamW eps (default %(default)s)")
    g.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULE_NAMES,
        default="constant",
        help="constant, or cosine decay to --min-lr at the last step; both after "
        "--warmup-steps of linear warm-up (default %(default)s)",
    )
    g.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="N",
        help="linear lr warm-up over the first N steps (default %(default)s)",
    )
    g.add_argument(
        "--min-lr",
        type=float,
        default=0.0,
        help="the cosine schedule's lr at the last step (default %(default)s)",
    )
    g.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        metavar="X",
        help="clip the global gradient norm of the whole model to X (default: no clipping)",
    )
    g.add_argument(
        "--zero-stage",
        default="0",
        metavar="Z",
        help="0: every replica of a stage keeps the whole optimizer state; 1: each replica of a "
        "replicated stage keeps and updates 1/r of it (gradients reduce-scattered, parameters "
        "all-gathered; ZeRO-1); 2: the accumulated gradients are sharded too, reduce-scattered "
        "after every micro-batch (ZeRO-2); 3: the parameters too, each replicated stage an FSDP2 "
        "root (ZeRO-3). A floor under the plan's own zero stage per stage; a no-op on stages "
        "with one replica "
        "(default %(default)s)",
    )


def zero_stage_flag(value: str) -> int:
    """``--zero-stage`` of ``train`` and ``verify``: 0, 1, 2 or 3.

    Raises:
        ValidationError: any other value (named).
    """
    from dapple.core.parallelism import ZERO_STAGES

    if value.strip().isdigit() and int(value) in ZERO_STAGES:
        return int(value)
    raise ValidationError(
        f"--zero-stage must be one of {', '.join(map(str, ZERO_STAGES))}, got {value!r}"
    )
