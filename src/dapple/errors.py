"""User-facing errors: one clear line naming the offending field and value."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

__all__ = [
    "DappleError",
    "InfeasibleError",
    "ValidationError",
    "check_integer_fields",
    "one_line",
    "positive_integers",
    "renamed_fields",
    "renamed_keywords",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_C = TypeVar("_C", bound=type)


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


def renamed_keywords(**new_of: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A decorator refusing a function's old keyword spellings (``old=new`` pairs) with a
    :class:`TypeError` that names the keyword it is now, before the function runs. A class's
    ``__init__`` is named by its class (``PlanConfig()``)."""

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        name = fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            old = [k for k in kwargs if k in new_of]
            if old:
                raise TypeError(
                    f"{name}() takes {new_of[old[0]]}= now, not {old[0]}= (same meaning)"
                )
            return fn(*args, **kwargs)

        return call

    return wrap


def renamed_fields(**new_of: str) -> Callable[[_C], _C]:
    """A class decorator (above ``@dataclass``): :func:`renamed_keywords` on the class's
    ``__init__``, so its old field spellings are refused naming the field it has now."""

    def wrap(cls: _C) -> _C:
        init = cls.__dict__["__init__"]
        setattr(cls, "__init__", renamed_keywords(**new_of)(init))  # noqa: B010
        return cls

    return wrap


_INTEGER_TYPES = {"int": False, "int | None": True}
"""The annotations of whole-number dataclass fields, and whether None is one of their values."""


def check_integer_fields(obj: Any) -> None:
    """Every field of the dataclass ``obj`` annotated ``int`` (or ``int | None``) holds an
    integer (``numbers.Integral``: Python's and NumPy's; a bool is not one) or None where
    allowed: the Python API passes values through as given, where the CLI parsed them.

    Raises:
        ValidationError: the first field that does not, named with its value.
    """
    for f in dataclasses.fields(obj):
        optional = _INTEGER_TYPES.get(str(f.type))
        if optional is None:
            continue
        v = getattr(obj, f.name)
        if v is None and optional:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValidationError(f"{f.name} must be an integer, got {v!r}")


def positive_integers(values: Iterable[object]) -> bool:
    """Whether ``values`` holds at least one value and each is an ``int`` (a bool is not one)
    of at least 1: a list of batch sizes or lengths, as the profilers take them."""
    got = list(values)
    return bool(got) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in got)
