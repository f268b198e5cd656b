"""Small helpers shared by the pure data model for JSON round-trips and field checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dapple.errors import ValidationError

__all__ = ["check_schema_version", "get_field", "load_json_file", "require"]


def load_json_file(path: str | Path, what: str) -> dict[str, Any]:
    """Read a JSON object from ``path``; ``what`` names the document in errors.

    Raises:
        ValidationError: the file is missing, unreadable, not JSON or not an object.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValidationError(f"cannot read {what} file {str(p)!r}: {e.strerror or e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(
            f"{what} file {str(p)!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from e
    if not isinstance(data, dict):
        raise ValidationError(
            f"{what} file {str(p)!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


def save_json_file(path: str | Path, data: dict[str, Any], what: str) -> None:
    """Write ``data`` as indented JSON to ``path``; ``what`` names the document in errors.

    Raises:
        ValidationError: the file cannot be written (missing folder, no permission, ...).
    """
    p = Path(path)
    try:
        p.write_text(json.dumps(data, indent=2) + "\n")
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


def get_field(data: dict[str, Any], key: str, what: str) -> Any:
    """``data[key]`` or a ValidationError naming the missing field."""
    if key not in data:
        raise ValidationError(f"{what}: missing field {key!r}")
    return data[key]
