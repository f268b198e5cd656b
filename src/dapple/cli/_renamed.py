"""Old spellings of options: refused, naming the option's one name in the CLI, the API and
run files."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["renamed"]


def renamed(new: str) -> type[argparse.Action]:
    """An argparse action for an option's old spelling: using it is one ``dapple: error:`` line
    that names ``new`` (which means the same), exit status 2, before any other flag is checked
    for being missing."""

    class Renamed(argparse.Action):
        def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
            kw.setdefault("nargs", "?")
            super().__init__(option_strings, dest, **kw)

        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            used = option_string or "/".join(self.option_strings)
            parser.exit(2, f"dapple: error: {used} is spelled {new} now (same meaning)\n")

    return Renamed
