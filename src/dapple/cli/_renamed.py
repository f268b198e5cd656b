"""Old spellings of options: refused, naming the option's one name in the CLI, the API and
run files."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["renamed"]


def renamed(new: str) -> type[argparse.Action]:
    """An argparse action for an option's old spelling: using it is an error that names
    ``new`` (which means the same)."""

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
            raise argparse.ArgumentError(self, f"is spelled {new} now (same meaning)")

    return Renamed
