"""The CLI's checks between a run's ``--precision`` and the profile it is compared with."""

from __future__ import annotations

import sys

__all__ = ["note_profile_precision"]


def note_profile_precision(profile_spec: str, precision: str) -> None:
    """Print a note to stderr when ``profile_spec`` was measured in another precision than the
    run computes in (its times, activation bytes and weight cast cache then do not match)."""
    from dapple.api._inputs import as_profile

    measured = as_profile(profile_spec).precision
    if measured != precision:
        print(
            f"note: profile {profile_spec} was measured in {measured} and this run computes in "
            f"{precision}; `dapple profile --precision {precision}` measures a matching one",
            file=sys.stderr,
        )
