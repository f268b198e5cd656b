"""A file a command reads is never the file it writes: checked for every command at once,
before it starts, from the parsed options' roles."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

from dapple.errors import ValidationError

__all__ = ["INPUT_OPTIONS", "OUTPUT_OPTIONS", "refuse_input_overwrite"]

INPUT_OPTIONS = ("plan", "profile", "cluster", "config", "data", "eval_data", "graph", "weights")
"""Options (argparse ``dest``) naming a file a command reads."""

OUTPUT_OPTIONS = ("output", "trace", "gantt", "memory", "layout", "metrics", "loss_curve")
"""Options naming a file a command writes (replacing what is there)."""


def _flag(dest: str) -> str:
    named = {"output": "-o/--output", "graph": "GRAPH"}  # GRAPH: import-pipedream's argument
    return named.get(dest, "--" + dest.replace("_", "-"))


def _paths(value: object) -> Iterator[str]:
    if isinstance(value, str | os.PathLike):
        yield os.fspath(value)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _paths(v)


def refuse_input_overwrite(args: argparse.Namespace) -> None:
    """Refuse an output option that names the same existing file as an input option.

    Raises:
        ValidationError: naming both options and the path.
    """
    for out in OUTPUT_OPTIONS:
        for target in _paths(getattr(args, out, None)):
            if not os.path.isfile(target):
                continue
            for src in INPUT_OPTIONS:
                for path in _paths(getattr(args, src, None)):
                    if os.path.isfile(path) and os.path.samefile(path, target):
                        raise ValidationError(
                            f"{_flag(out)} {target!r} is the {_flag(src)} file this command "
                            "reads: writing it would replace that input; write elsewhere"
                        )
