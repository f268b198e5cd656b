"""User-facing errors: one clear line naming the offending field and value."""

from __future__ import annotations

__all__ = ["DappleError", "InfeasibleError", "ValidationError"]


class DappleError(Exception):
    """Base class of every error the CLI reports as one line without a traceback."""


class ValidationError(DappleError, ValueError):
    """An input (profile, cluster, plan, schedule, file) is malformed or inconsistent."""


class InfeasibleError(DappleError):
    """No plan satisfies the constraints (memory, batch divisibility, device count)."""
