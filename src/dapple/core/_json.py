"""Small helpers shared by the pure data model for JSON round-trips and field checks."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from dapple.errors import ValidationError
from dapple.files.output_path import make_parent_dirs
from dapple.files.text_file import read_text_file

__all__ = [
    "as_float",
    "as_list",
    "as_nonneg",
    "check_schema_version",
    "get_field",
    "load_json_file",
    "parse_json_text",
    "require",
]


def parse_json_text(text: str, where: str) -> Any:
    """``json.loads(text)``; ``where`` (e.g. ``"plan file 'p.json'"``) names the text in errors.

    Raises:
        ValidationError: not JSON, or nested deeper than the parser can follow.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(
            f"{where} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise ValidationError(
            f"{where} is nested too deeply (arrays or objects over ~{sys.getrecursionlimit()} "
            "levels)"
        ) from None


def load_json_file(path: str | Path, what: str) -> dict[str, Any]:
    """Read a JSON object from ``path``; ``what`` names the document in errors.

    Raises:
        ValidationError: the file is missing, unreadable, not UTF-8, not JSON (or nested too
            deeply) or not an object.
    """
    p = Path(path)
    data = parse_json_text(read_text_file(p, f"{what} file"), f"{what} file {str(p)!r}")
    if not isinstance(data, dict):
        raise ValidationError(
            f"{what} file {str(p)!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


def save_json_file(path: str | Path, data: dict[str, Any], what: str) -> None:
    """Write ``data`` as indented JSON to ``path`` (missing folders made); ``what`` names the
    document in errors.

    Raises:
        ValidationError: the file cannot be written (a folder on the way is a file, no
            permission, ...).
    """
    p = Path(path)
    try:
        make_parent_dirs(p).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise ValidationError(f"cannot write {what} file {str(p)!r}: {e.strerror or e}") from e


def require(cond: bool, msg: str) -> None:
    """Raise ``ValidationError(msg)`` unless ``cond``."""
    if not cond:
        raise ValidationError(msg)


def check_schema_version(data: dict[str, Any], current: int, what: str) -> None:
    """Reject documents written by a newer schema than this code understands."""
    v = data.get("schema_version", current)
    require(isinstance(v, int), f"{what}: schema_version must be an integer, got {v!r}")
    require(
        v <= current,
        f"{what}: schema_version {v} is newer than this dapple understands ({current}); upgrade dapple",
    )


def as_float(x: Any, what: str) -> float:
    """``float(x)`` for a JSON number (or a string holding one); ``what`` names the field.

    Raises:
        ValidationError: ``x`` is no number (a list, an object, a boolean, ``null``, text).
    """
    if isinstance(x, bool) or not isinstance(x, (int, float, str)):
        raise ValidationError(f"{what} must be a number, got {x!r}")
    try:
        return float(x)
    except (ValueError, OverflowError):
        raise ValidationError(f"{what} must be a number, got {x!r}") from None


def get_field(data: dict[str, Any], key: str, what: str) -> Any:
    """``data[key]`` or a ValidationError naming the missing field."""
    if key not in data:
        raise ValidationError(f"{what}: missing field {key!r}")
    return data[key]


def as_list(v: Any, what: str) -> list[Any]:
    """``v`` when it is a JSON list; ``what`` names the field.

    Raises:
        ValidationError: ``v`` is no list.
    """
    require(isinstance(v, list), f"{what} must be a list, got {v!r}"[:200])
    return list(v)


def as_nonneg(v: Any, what: str) -> float:
    """``float(v)`` for a finite number >= 0; ``what`` names the field.

    Raises:
        ValidationError: ``v`` is no number, a boolean, infinite, NaN or negative.
    """
    require(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
        f"{what} must be a finite number >= 0, got {v!r}",
    )
    return float(v)
