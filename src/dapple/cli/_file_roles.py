"""A file a command reads is never the file it writes: checked for every command at once,
before it starts, from the parsed options' roles."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

from dapple.files.output_path import refuse_overwrite

__all__ = ["INPUT_OPTIONS", "OUTPUT_OPTIONS", "refuse_input_overwrite"]

INPUT_OPTIONS = (
    "plan", "profile", "cluster", "config", "data", "eval_data", "graph", "weights", "text_files",
)  # fmt: skip
"""Options (argparse ``dest``) naming a file a command reads."""

OUTPUT_OPTIONS = ("output", "trace", "gantt", "memory", "layout", "metrics", "loss_curve")
"""Options naming a file a command writes (replacing what is there)."""

_NAMED = {"output": "-o/--output", "graph": "GRAPH", "text_files": "TEXT_FILE"}
"""Flags that are not ``--`` and the dest: import-pipedream's GRAPH, data prepare's TEXT_FILE."""


def _flag(dest: str) -> str:
    return _NAMED.get(dest, "--" + dest.replace("_", "-"))


def _paths(value: object) -> Iterator[str]:
    if isinstance(value, str | os.PathLike):
        yield os.fspath(value)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _paths(v)


def _role(args: argparse.Namespace, options: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(path, flag)`` of every path the ``options`` of ``args`` name."""
    return [(p, _flag(o)) for o in options for p in _paths(getattr(args, o, None))]


def refuse_input_overwrite(args: argparse.Namespace) -> None:
    """Refuse an output option that would replace a file an input option names
    (:func:`dapple.files.output_path.refuse_overwrite`).

    Raises:
        ValidationError: naming both options and the path.
    """
    refuse_overwrite(_role(args, OUTPUT_OPTIONS), _role(args, INPUT_OPTIONS))
