"""``dapple plan``'s flags as :class:`~dapple.planner.plan_config.PlanConfig` fields, and its
``--config FILE`` / ``--print-config``.

:func:`plan_flags` is the one table from the parsed flags to the config: :func:`plan_config_of`
builds the :class:`PlanConfig` of ``--config FILE`` with the flags the command line gave on
top, which ``dapple plan`` then runs. Torch-free.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from dapple.cli._config_args import ConfigFile, Flag, add_config_arguments, config_of, one
from dapple.errors import ValidationError

if TYPE_CHECKING:
    from dapple.core.planning_options import ZeroChoice
    from dapple.planner.plan_config import PlanConfig

__all__ = [
    "SeqLenParser",
    "add_plan_config_arguments",
    "parse_tensor_widths",
    "parse_zero_stage",
    "plan_config_of",
    "plan_flags",
]


def parse_zero_stage(text: str) -> ZeroChoice:
    """``--zero-stage``: ``"auto"`` -> ``"auto"``, ``"2"`` -> ``2``.

    Raises:
        ValidationError: not one of :data:`~dapple.core.planning_options.ZERO_CHOICES`.
    """
    from dapple.core.planning_options import ZERO_CHOICES, zero_choice
    from dapple.planner.plan_config import choices

    zero = zero_choice(int(text) if text.strip().lstrip("-").isdigit() else text)
    if zero is None:
        raise ValidationError(f"--zero-stage must be one of {choices(ZERO_CHOICES)}, got {text!r}")
    return zero


def _zero_stage(text: str) -> tuple[ZeroChoice]:
    return (parse_zero_stage(text),)


def parse_tensor_widths(text: str) -> str | tuple[int, ...]:
    """``--tensor-widths``: ``"auto"`` -> ``"auto"``, ``"4,1,2"`` -> ``(1, 2, 4)``.

    Raises:
        ValidationError: neither ``auto`` nor comma-separated widths of 1, 2, 4, 8.
    """
    from dapple.core.tensor_layout import TENSOR_WIDTHS
    from dapple.planner.plan_config import AUTO

    if text.strip() == AUTO:
        return AUTO
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) in TENSOR_WIDTHS for p in parts):
        raise ValidationError(
            f"--tensor-widths must be auto or comma-separated widths from "
            f"{', '.join(map(str, TENSOR_WIDTHS))}, got {text!r}"
        )
    return tuple(sorted({int(p) for p in parts}))


def _widths_fields(text: str) -> tuple[str | tuple[int, ...]]:
    return (parse_tensor_widths(text),)


SeqLenParser = Callable[[str], tuple[float, float]]
"""``dapple plan``'s ``--mean-seq-len MEAN[,MAX]`` parser
(:func:`dapple.cli.plan_cmd.parse_mean_seq_len`)."""


def plan_flags(parse_mean_seq_len: SeqLenParser) -> tuple[Flag, ...]:
    """Every flag of ``dapple plan`` but ``--config``, ``--print-config`` and ``--compare``, as
    :class:`~dapple.planner.plan_config.PlanConfig` fields (``--mean-seq-len`` read by
    ``parse_mean_seq_len``).
    """

    def lengths(text: str | None) -> tuple[float | None, float | None]:
        return (None, None) if text is None else parse_mean_seq_len(text)

    return (
        *(one("", n) for n in ("profile", "cluster", "servers", "global_batch_size", "planner")),
        Flag("mean_seq_len", (("", "mean_seq_len"), ("", "max_seq_len")), lengths),
        *(one("", n) for n in ("output", "schedule", "virtual_stages")),
        Flag("zero_stage", (("", "zero_stage"),), _zero_stage),
        Flag("tensor_widths", (("", "tensor_widths"),), _widths_fields),
        one("", "interleave"),
        one("", "on_nonfinite"),
    )


_REQUIRED = {("", "profile"): "--profile", ("", "cluster"): "--cluster"}


def add_plan_config_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and ``--print-config`` to ``dapple plan``'s parser ``p``."""
    add_config_arguments(p, ("profile", "cluster"), "its [planning] section")


def plan_config_of(args: argparse.Namespace, parse_mean_seq_len: SeqLenParser) -> PlanConfig | None:
    """The plan ``--config FILE`` and the flags the command line gave on top (those win) ask
    for; with ``--print-config`` that printed as TOML instead (None).

    Raises:
        ValidationError: a bad file or value, or no profile or cluster.
    """
    from dapple.planner.plan_config import (
        PLAN_SECTIONS,
        PlanConfig,
        dump_plan_config,
        load_plan_config,
    )

    file = ConfigFile(
        PlanConfig,
        PLAN_SECTIONS,
        lambda path, over: load_plan_config(path, over=over),
        dump_plan_config,
        _REQUIRED,
    )
    return config_of(args, plan_flags(parse_mean_seq_len), file)
