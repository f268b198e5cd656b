"""``dapple profile --config FILE`` / ``--print-config``: the model from a run file's ``[model]``
section (:class:`~dapple.api.run_config.ModelConfig`), as ``dapple train --config`` reads it.

The model flags (``-m``, ``--set``, ``--split-at``, ``--weights``, ``--dynamic-dims``) are
:data:`dapple.cli._train_flags.TRAIN_FLAGS`' own rows; flags given beside ``--config`` win
(``--set`` is merged into ``[model] set``), and the file's other sections (``dapple train``'s,
``dapple plan``'s ``[planning]``) are skipped unread. :func:`model_config_of` reads the model
that way, with or without a file. Torch-free at import time.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dapple.cli._config_args import ConfigFile, Flag, add_config_arguments, config_of
from dapple.cli._train_flags import TRAIN_FLAGS

if TYPE_CHECKING:
    from dapple.api.run_config import ModelConfig

__all__ = ["MODEL_FLAGS", "add_profile_config_arguments", "model_config_of"]

MODEL_FLAGS: tuple[Flag, ...] = tuple(
    Flag(f.dest, tuple(("", name) for _, name in f.fields), f.to_fields, f.to_flag)
    for f in TRAIN_FLAGS
    if all(part == "model" for part, _ in f.fields)
)
"""``dapple train``'s model flags as :class:`ModelConfig` fields (the ``[model]`` section)."""

_OTHER_SECTIONS = (
    "plan", "data", "train", "optimizer", "checkpoint", "eval", "report", "elastic", "planning",
    "simulate",
)  # fmt: skip
"""The sections ``dapple train``, ``dapple plan`` and ``dapple simulate`` read besides
``[model]``."""


def add_profile_config_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and ``--print-config`` to ``dapple profile``'s parser ``p`` (every
    other flag already added)."""
    add_config_arguments(p, ("model",), "its [model] section, as dapple train reads it")


def model_config_of(args: argparse.Namespace) -> ModelConfig | None:
    """The model ``--config FILE``'s ``[model]`` section and the model flags given on top (those
    win) ask for; with ``--print-config`` that section printed as TOML instead (None).

    Raises:
        ValidationError: a bad file or value, or no model at all.
    """
    from dapple.api.run_config import ModelConfig
    from dapple.files.config_file import dump, load

    schema = {"model": tuple(f for flag in MODEL_FLAGS for f in flag.fields)}
    file = ConfigFile(
        ModelConfig,
        schema,
        lambda path, over: load(path, schema, ModelConfig, ignore=_OTHER_SECTIONS, over=over),
        lambda cfg: dump(cfg, schema, "dapple profile --config FILE (flags given beside it win)"),
        {("", "spec"): "-m/--model"},
    )
    return config_of(args, MODEL_FLAGS, file)
