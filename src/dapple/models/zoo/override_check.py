"""Check a zoo model's overrides (``--set KEY=VALUE``) against its builder's annotations
before the builder runs, so ``--set layers=2.5`` or a ``--set 'seq_choices=[8,'`` that did
not parse as JSON is refused in one line naming the key, not deep inside the model build."""

from __future__ import annotations

import collections.abc
import types
import typing
from collections.abc import Callable
from typing import Any

from dapple.errors import ValidationError

__all__ = ["check_override_types"]


def _fits(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` is of type ``hint``; None where the hint is not one this checks."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_fits(value, a) for a in args]
        return True if any(verdicts) else (None if None in verdicts else False)
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 1 or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
            verdicts = [_fits(v, args[0]) for v in value]
            return False if False in verdicts else (None if None in verdicts else True)
        return None
    return None


def _name(hint: Any) -> str:
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    return text.replace("collections.abc.", "").replace("typing.", "").replace("NoneType", "None")


def check_override_types(builder: Callable[..., Any], what: str, overrides: dict[str, Any]) -> None:
    """Refuse an override whose value does not match the annotation of ``builder``'s parameter
    of that name (unknown names are left to the call, which lists the accepted ones).

    Raises:
        ValidationError: ``what: KEY=VALUE is not TYPE``.
    """
    try:
        hints = typing.get_type_hints(builder)
    except Exception:  # unresolvable annotations: nothing to check against
        return
    for key, value in overrides.items():
        if key in hints and _fits(value, hints[key]) is False:
            raise ValidationError(
                f"{what}: {key}={value!r} is not {_name(hints[key])} (--set takes JSON values, "
                "e.g. layers=4, seq_choices=[8,16])"
            )
