"""Typed TOML configuration files: a file's ``[section] key = value`` lines onto frozen
dataclasses, and back.

A *schema* says which dataclass field each key of each section sets: ``{"optimizer": (("train",
"lr"), ...)}`` - the key is the field's name; the *part* (``"train"``) is the root dataclass's
field that holds the dataclass the key sets, or ``""`` for the root itself. Sections group the
keys for people; the parts are how the code keeps them. Reading checks every key and value
before anything is built: an unknown section or key names the file and the closest valid one,
a value of the wrong type names the key, the value and the type the field wants. TOML has no
null: a field left out keeps its default, and :func:`dump` writes a field that is None as a
comment.

Pure and torch-free (``tomllib``, Python >= 3.11; ``tomli`` before).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import operator
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

from dapple.errors import ValidationError
from dapple.files.text_file import read_text_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "Field",
    "FieldError",
    "Schema",
    "Values",
    "build",
    "build_over",
    "coerce",
    "dump",
    "field_types",
    "load",
    "merge_values",
    "parse_values",
    "read_toml",
    "values_of",
]

Field = tuple[str, str]
"""``(part, field)``: the root's field holding a dataclass (``""``: the root) and a field of it."""
Schema = Mapping[str, Sequence[Field]]
"""Section name -> the fields its keys set (each key is its field's name)."""
Values = dict[Field, Any]
"""Field -> value: what a file or a command line sets."""

T = TypeVar("T", bound="DataclassInstance")


class FieldError(ValidationError):
    """A dataclass's own check refused a value while :func:`build` set the fields of ``part``
    (None: the root's check). The message opens with the field it refuses, as the Python API
    spells it: a front door renames it to its own spelling (a command line's flag)."""

    def __init__(self, message: str, part: str | None) -> None:
        super().__init__(message)
        self.part = part


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file.

    Raises:
        ValidationError: a missing or unreadable file, or a TOML syntax error (with its line).
    """
    p = Path(path)
    text = read_text_file(p, "config file")
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValidationError(f"config file {str(p)!r}: {e}") from None
    except RecursionError:
        raise ValidationError(f"config file {str(p)!r} is nested too deeply") from None
    return data


def field_types(root: type[DataclassInstance], schema: Schema) -> dict[Field, Any]:
    """The type of every field the schema names (resolved annotations)."""
    hints = typing.get_type_hints(root)
    out: dict[Field, Any] = {}
    for fields in schema.values():
        for part, name in fields:
            owner = root if part == "" else hints[part]
            out[(part, name)] = typing.get_type_hints(owner)[name]
    return out


def parse_values(
    data: Mapping[str, Any],
    schema: Schema,
    root: type[DataclassInstance],
    where: str,
    *,
    ignore: Sequence[str] = (),
    renamed: Mapping[str, str] | None = None,
) -> Values:
    """Check the tables of a file against ``schema`` and the field types; the values it sets.

    Args:
        data: the file's tables (:func:`read_toml`).
        schema: its sections.
        root: the dataclass the schema's parts are fields of.
        where: the file, named in errors.
        ignore: sections of other commands, skipped unread.
        renamed: old spellings of keys, each refused naming its key now.

    Raises:
        ValidationError: an unknown section or key (with the closest valid one, or the key an
            old spelling is now), a key outside a section, or a value of the wrong type
            (naming key, value and expected type).
    """
    types_ = field_types(root, schema)
    out: Values = {}
    for section, table in data.items():
        if section in ignore:
            continue
        if section not in schema:
            if not isinstance(table, dict):
                raise ValidationError(
                    f"{where}: key {section!r} is outside any section; put it under one of "
                    + ", ".join(f"[{s}]" for s in schema)
                )
            raise ValidationError(
                f"{where}: unknown section [{section}]{_closest(section, list(schema), '[', ']')}"
            )
        if not isinstance(table, dict):
            raise ValidationError(
                f"{where}: [{section}] must be a table, got {section} = {table!r}"
            )
        by_key = {name: (part, name) for part, name in schema[section]}
        for key, value in table.items():
            if key not in by_key and renamed and key in renamed:
                raise ValidationError(
                    f"{where}: [{section}] {key} is spelled {renamed[key]} now (same meaning)"
                )
            if key not in by_key:
                raise ValidationError(
                    f"{where}: unknown key {key!r} in [{section}]{_misplaced(key, section, schema)}"
                )
            f = by_key[key]
            out[f] = coerce(value, types_[f], f"{where}: [{section}] {key}")
    return out


def _misplaced(key: str, section: str, schema: Schema) -> str:
    """Where ``key`` belongs instead, or the closest key of ``section``."""
    for other, fields in schema.items():
        if any(name == key for _, name in fields):
            return f"; it belongs in [{other}]"
    return _closest(key, [name for _, name in schema[section]], "", "")


def _closest(word: str, options: Sequence[str], pre: str, post: str) -> str:
    near = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    if near:
        return f"; did you mean {pre}{near[0]}{post}?"
    return f"; valid: {', '.join(pre + o + post for o in options)}"


def coerce(value: Any, tp: Any, what: str) -> Any:
    """``value`` as a field of type ``tp`` holds it (arrays as tuples, integers as floats where
    a float is wanted).

    Raises:
        ValidationError: ``value`` does not fit ``tp`` (naming ``what``, the value and the type).
    """
    ok, out = _fit(value, tp)
    if not ok:
        raise ValidationError(
            f"{what} = {_toml_value(value, strict=False)}: expected {_type_name(tp)}, "
            f"got {_value_kind(value)}"
        )
    return out


def _fit(value: Any, tp: Any) -> tuple[bool, Any]:
    """``(True, converted)`` when ``value`` fits ``tp``, else ``(False, None)``."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    if origin is Literal:  # the type of one of the values; the dataclass checks the value
        return _fit(value, _literal_types(tp))
    if isinstance(tp, type) and issubclass(tp, Enum):  # the dataclass checks the value
        return True, value
    if origin in (Union, types.UnionType):
        for member in typing.get_args(tp):
            if member is type(None):
                continue
            ok, out = _fit(value, member)
            if ok:
                return True, out
        return False, None
    if origin is tuple:
        return _fit_tuple(value, typing.get_args(tp))
    if origin in (dict, Mapping) or tp is dict:
        return (True, dict(value)) if isinstance(value, dict) else (False, None)
    if tp is bool:
        return (True, value) if isinstance(value, bool) else (False, None)
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return (True, value) if ok else (False, None)
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return (True, float(value)) if ok else (False, None)
    if tp is str:
        return (True, value) if isinstance(value, str) else (False, None)
    raise TypeError(f"config files cannot hold a field of type {tp!r}")  # pragma: no cover


def _fit_tuple(value: Any, args: tuple[Any, ...]) -> tuple[bool, Any]:
    if not isinstance(value, list):
        return False, None
    each = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
    if len(each) != len(value):
        return False, None
    out = []
    for v, t in zip(value, each, strict=True):
        ok, item = _fit(v, t)
        if not ok:
            return False, None
        out.append(item)
    return True, tuple(out)


def _literal_types(tp: Any) -> Any:
    """The union of the types of a ``Literal``'s values: ``int | str`` for ``Literal[0, "a"]``."""
    return functools.reduce(operator.or_, dict.fromkeys(type(v) for v in typing.get_args(tp)))


def _type_name(tp: Any) -> str:
    """``float``, ``int or str``, ``an array of 2 floats``, ``an array of str``, ``a table``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _type_name(_literal_types(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp) if t is not type(None))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"an array of {_type_name(args[0])}"
        return f"an array of {len(args)} {' and '.join(sorted({_type_name(a) for a in args}))}s"
    if origin in (dict, Mapping) or tp is dict:
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _value_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return f"an array of {len(value)}"
    return type(value).__name__


def merge_values(*layers: Values) -> Values:
    """Later layers over earlier ones (a table merged key by key, e.g. a command line's
    ``--set`` over the file's ``[model] set``)."""
    out: Values = {}
    for layer in layers:
        for f, v in layer.items():
            old = out.get(f)
            out[f] = {**old, **v} if isinstance(old, dict) and isinstance(v, dict) else v
    return out


def build(root: type[T], values: Values) -> T:
    """``root`` with ``values`` set and every other field at its default.

    Raises:
        FieldError: the dataclasses' own checks (``__post_init__``), with the part whose check
            it was (None: the root's).
    """
    hints = typing.get_type_hints(root)
    own: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for (part, name), v in values.items():
        if part == "":
            own[name] = v
        else:
            parts.setdefault(part, {})[name] = v
    for part, kwargs in parts.items():
        try:
            own[part] = hints[part](**kwargs)
        except ValidationError as e:
            raise FieldError(str(e), part) from None
    try:
        return root(**own)
    except FieldError:
        raise
    except ValidationError as e:
        raise FieldError(str(e), None) from None


def build_over(root: type[T], values: Values, over: Values, where: str) -> T:
    """``root`` with a file's ``values`` and ``over`` (a command line's) on top; an error the
    file alone makes names the file (``where``).

    Raises:
        FieldError: a check that ``over`` fails (the file alone passes).
        ValidationError: a check that the file alone fails, naming ``where``.
    """
    try:
        return build(root, merge_values(values, over))
    except ValidationError as e:
        if over:
            try:
                build(root, values)
            except ValidationError:
                pass
            else:
                raise  # the file alone is fine: a flag is at fault
        raise ValidationError(f"{where}: {e}") from None


def load(
    path: str | Path,
    schema: Schema,
    root: type[T],
    *,
    ignore: Sequence[str] = (),
    over: Values | None = None,
    renamed: Mapping[str, str] | None = None,
) -> T:
    """``root`` from the file at ``path`` (its ``schema`` sections; ``ignore``: other
    commands' sections; ``renamed``: old spellings of keys) with ``over`` on top
    (:func:`parse_values`, :func:`build_over`).

    Raises:
        ValidationError: an unreadable file, an unknown section or key, a value of the wrong
            type, or a bad option (each naming the file).
    """
    where = str(path)
    values = parse_values(read_toml(path), schema, root, where, ignore=ignore, renamed=renamed)
    return build_over(root, values, over or {}, where)


def values_of(obj: DataclassInstance, schema: Schema) -> Values:
    """Every field the schema names, as ``obj`` holds it."""
    out: Values = {}
    for fields in schema.values():
        for part, name in fields:
            holder = obj if part == "" else getattr(obj, part)
            out[(part, name)] = getattr(holder, name)
    return out


def dump(obj: DataclassInstance, schema: Schema, header: str = "") -> str:
    """``obj`` as a TOML file of ``schema``'s sections (reads back to an equal object); fields
    that are None are written as comments.

    Raises:
        ValidationError: a value TOML cannot hold (None inside a table or an array).
    """
    types_ = field_types(type(obj), schema)
    values = values_of(obj, schema)
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for section, fields in schema.items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        for f in fields:
            v = values[f]
            if v is None:
                lines.append(f"# {f[1]} = <{_type_name(types_[f])}>  (unset)")
            else:
                lines.append(f"{f[1]} = {_toml_value(v, where=f'[{section}] {f[1]}')}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any, *, strict: bool = True, where: str = "") -> str:
    """One TOML value (``strict``: refuse what TOML cannot hold)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x, strict=strict, where=where) for x in v) + "]"
    if isinstance(v, dict):
        items = (
            f"{_toml_key(str(k))} = {_toml_value(x, strict=strict, where=where)}"
            for k, x in v.items()
        )
        return "{ " + ", ".join(items) + " }" if v else "{}"
    if strict:
        raise ValidationError(f"{where}: TOML cannot hold {v!r}")
    return repr(v)


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)
