"""User-facing errors: one clear line naming the offending field and value."""

from __future__ import annotations

__all__ = ["DappleError", "InfeasibleError", "ValidationError", "one_line"]


class DappleError(Exception):
    """Base class of every error the CLI reports as one line without a traceback."""


class ValidationError(DappleError, ValueError):
    """An input (profile, cluster, plan, schedule, file) is malformed or inconsistent."""


class InfeasibleError(DappleError):
    """No plan satisfies the constraints (memory, batch divisibility, device count)."""


def one_line(e: BaseException) -> str:
    """Another library's error message on one line (its lines and runs of spaces joined by
    single spaces), to quote inside a ``dapple: error:`` line."""
    return " ".join(str(e).split())
