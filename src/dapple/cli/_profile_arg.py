"""``--profile``: one model profile, or one per device kind of a mixed cluster.

``--profile FILE`` (or ``paper:NAME``) gives the one profile; ``--profile KIND=FILE``, once per
device kind of the cluster, gives each kind its own (:mod:`dapple.core.kind_profiles`). The
flags given are joined into one spec, ``KIND=FILE,KIND=FILE``, the spelling of a config file's
``profile`` key.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["add_profile_argument"]

HELP = (
    "model profile JSON, or a paper profile: paper:bert48; on a cluster with device kinds, "
    "KIND=FILE once per kind gives each kind its own profile (e.g. --profile H100=h100.json "
    "--profile A100=a100.json, from `dapple profile --analytic h100` and `--analytic a100`)"
)


class _JoinKinds(argparse.Action):
    """Keep the last value of a plain ``--profile``; join ``KIND=FILE`` values with ``,``;
    refuse a plain one beside ``KIND=FILE`` ones (either would drop the other unsaid)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        new = str(values)
        old = getattr(namespace, self.dest, None)
        if isinstance(old, str) and ("=" in old) != ("=" in new):
            plain, kinds = (new, old) if "=" in old else (old, new)
            parser.error(
                f"--profile {plain} gives every device kind one profile, --profile {kinds} one "
                "kind its own: give either one plain --profile or KIND=FILE once per kind"
            )
        if isinstance(old, str) and "=" in old and "=" in new:
            new = f"{old},{new}"
        setattr(namespace, self.dest, new)


def add_profile_argument(
    p: argparse.ArgumentParser, *, required: bool = True, help: str = HELP
) -> None:
    """Add ``--profile`` (module docstring) to ``p``: required, with :data:`HELP`, unless
    told otherwise."""
    p.add_argument("--profile", required=required, default=None, action=_JoinKinds, help=help)
