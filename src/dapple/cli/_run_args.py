"""Flags of the commands that run a plan (``train``, ``verify``) and the ``--device`` flag.

``dapple train`` and ``dapple verify`` both call :func:`add_run_arguments`, so they spell,
default and document their common flags alike. Torch-free at import time: the optimizer names
come from :data:`dapple.runtime.train_config.OPTIMIZERS` only when argparse reads the choices.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import overload

from dapple.cli._data_args import add_data_arguments
from dapple.cli._model_args import add_model_arguments
from dapple.cli._optim_args import add_optim_arguments
from dapple.cli._renamed import takes_value
from dapple.core.planning_options import NONFINITE_MODES
from dapple.core.recompute import STAGE_RECOMPUTE, recompute_of
from dapple.schedule.registry import schedule_names

__all__ = [
    "RUN_DEVICES",
    "add_device_argument",
    "add_precision_argument",
    "add_recompute_argument",
    "add_run_arguments",
]

RUN_DEVICES = ("auto", "cpu", "cuda")
"""``--device`` choices of ``train`` and ``verify`` (what :class:`~dapple.runtime.TrainConfig`
accepts)."""


class _OptimizerNames(Sequence[str]):
    """The runtime's optimizer names, imported on first use (the runtime package imports torch;
    building the parser must not)."""

    @staticmethod
    def _names() -> tuple[str, ...]:
        from dapple.runtime.train_config import OPTIMIZERS

        return tuple(OPTIMIZERS)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


def add_device_argument(p: argparse.ArgumentParser, choices: Sequence[str] | None = None) -> None:
    """Add ``--device`` (default ``auto``: ``cuda`` when available, else ``cpu``) to ``p``.

    Args:
        p: the command's parser.
        choices: the accepted names; ``None`` also accepts ``cuda:N``.
    """
    names = "auto, cpu or cuda[:N]" if choices is None else ", ".join(choices)
    p.add_argument(
        "--device",
        choices=choices,
        default="auto",
        metavar="DEVICE",
        help=f"{names} (default auto: cuda when available, else cpu)",
    )


def add_run_arguments(p: argparse.ArgumentParser, *, steps: int) -> None:
    """Add the flags ``dapple train`` and ``dapple verify`` share to ``p``.

    ``--plan``, ``-m/--model`` (with ``--set``, ``--split-at``), ``--steps``, ``--seed``,
    ``--optimizer`` (the runtime's names), ``--lr``, ``--schedule``, ``--policy``,
    ``--device``, ``--timeout-s``, ``--data``, ``--seq-len``, ``--precision`` and the
    optimisation flags (:func:`dapple.cli._optim_args.add_optim_arguments`).

    Args:
        p: the command's parser.
        steps: the default of ``--steps``.
    """
    p.add_argument("--plan", required=True, help="plan JSON file (from `dapple plan`)")
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps (default %(default)s)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="weights seed; step t uses batch seed+t, or with --data the shuffle seed (default 0)",
    )
    p.add_argument(
        "--optimizer",
        choices=_OptimizerNames(),
        default="sgd",
        metavar="NAME",
        help="one of %(choices)s (default %(default)s)",
    )
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default %(default)s)")
    p.add_argument(
        "--schedule",
        choices=schedule_names(),
        default=None,
        help="run this schedule instead of the plan's (interleaved: --virtual-stages chunks per "
        "device group; zbh1: the backward split into input- and weight-gradient halves)",
    )
    add_virtual_stages_argument(p)
    p.add_argument(
        "--policy",
        choices=("A", "B"),
        default=None,
        help="DAPPLE warm-up policy (K_i) instead of the plan's",
    )
    add_device_argument(p, RUN_DEVICES)
    p.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="fail instead of waiting longer than this on a peer, seconds (default %(default)s)",
    )
    add_data_arguments(p)
    add_optim_arguments(p)
    add_precision_argument(p)


def add_virtual_stages_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--virtual-stages V`` (chunks per device group under ``--schedule interleaved``)."""
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        metavar="V",
        help="model chunks per device group with --schedule interleaved (default %(default)s)",
    )


def add_on_nonfinite_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--on-nonfinite`` (the run's non-finite mode, as ``dapple train``'s) to a command
    that simulates the run: its step point."""
    p.add_argument(
        "--on-nonfinite",
        choices=NONFINITE_MODES,
        default="stop",
        help="the run's non-finite mode (as dapple train's): stop or skip end each step in the "
        "guard's collective, which every rank waits for; off: none, the step time is the "
        "period of consecutive steps, which overlap (default %(default)s)",
    )


def add_precision_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--precision`` (``fp32``, ``bf16``, ``fp16``; default fp32) to ``p``. The names are
    checked by :class:`~dapple.runtime.TrainConfig` (one error line), not by argparse."""
    p.add_argument(
        "--precision",
        default="fp32",
        metavar="P",
        help="fp32, bf16 or fp16: autocast dtype of the forward (weights and optimizer state "
        "stay fp32; fp16 scales the loss dynamically; CPU: fp32 or bf16) (default %(default)s)",
    )


def add_recompute_argument(p: argparse.ArgumentParser) -> None:
    """``--recompute none|full``: what every stage re-computes (``TrainConfig.recompute``); the
    bare switch it was is refused naming the values (:func:`~dapple.cli._renamed.takes_value`)."""
    p.add_argument(
        "--recompute",
        action=takes_value(STAGE_RECOMPUTE, "full", recompute_of),
        default=None,
        help="what every stage re-computes in its backward: full (its forward, keeping only "
        "its input) or none (default: each stage as the plan says)",
    )
