"""Old spellings of options: refused, naming the option's one name in the CLI, the API and
run files."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from dapple.errors import ValidationError

__all__ = ["renamed", "takes_value"]


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


def takes_value(
    choices: Sequence[str], bare: str, check: Callable[[Any, str], object]
) -> type[argparse.Action]:
    """An argparse action for an option that was a switch and now takes one of ``choices``:
    given without a value it is one ``dapple: error:`` line naming the values and ``bare``
    (what the switch meant), exit status 2; a value is ``check(value, option)``-ed, its
    ValidationError one such line (it names the option and ``choices``)."""

    class TakesValue(argparse.Action):
        def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
            kw.setdefault("nargs", "?")
            kw.setdefault("metavar", "{" + ",".join(choices) + "}")
            super().__init__(option_strings, dest, **kw)

        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            used = option_string or "/".join(self.option_strings)
            if values is None:
                parser.exit(
                    2,
                    f"dapple: error: {used} takes {' or '.join(choices)} now "
                    f"(the bare switch was {used} {bare})\n",
                )
            try:
                check(values, used)
            except ValidationError as e:
                parser.exit(2, f"dapple: error: {e}\n")
            setattr(namespace, self.dest, values)

    return TakesValue
