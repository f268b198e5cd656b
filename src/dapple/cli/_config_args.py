"""``--config FILE`` and ``--print-config``: a command's flags as one typed configuration.

A command lists its flags as :class:`Flag` rows: the parsed flag (its ``dest``), the config
fields it sets and how its value converts (and back). :func:`add_config_arguments` adds the two
flags and marks every other flag so that the parsed namespace records which ones the command
line gave; :func:`given_values` turns those - and only those - into config values, which go on
top of the file's. A flag the command line did not give thus never hides a value of the file,
and the defaults are the dataclasses' (a test keeps each flag's default equal to its field's).

Torch-free at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from dapple.errors import ValidationError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from dapple.files.config_file import Schema

C = TypeVar("C", bound="DataclassInstance")

__all__ = [
    "ConfigFile",
    "Flag",
    "add_config_arguments",
    "config_of",
    "flags_named",
    "given",
    "given_values",
    "missing_required",
    "parsed_values",
    "record_given_flags",
]

_GIVEN = "_dapple_given_flags"
"""Namespace attribute: the dests of the flags the command line gave."""
_TYPED = "_dapple_typed_flags"
"""Namespace attribute: dest -> the option string the command line gave it as (``-m``,
``--save-every``)."""

CLI_ONLY_DESTS = ("config", "print_config")


def _same(value: Any) -> tuple[Any, ...]:
    return (value,)


def _first(values: tuple[Any, ...]) -> Any:
    return values[0]


@dataclass(frozen=True)
class Flag:
    """One flag of a command as config fields."""

    dest: str
    """The flag's ``dest`` in the parsed namespace."""
    fields: tuple[tuple[str, str], ...]
    """The ``(part, field)`` it sets (:mod:`dapple.files.config_file`)."""
    to_fields: Callable[[Any], tuple[Any, ...]] = _same
    """The parsed value as the fields' values (one each)."""
    to_flag: Callable[[tuple[Any, ...]], Any] = _first
    """The fields' values as the parsed flag's."""


def one(part: str, field: str, dest: str | None = None, **convert: Any) -> Flag:
    """A flag ``dest`` (default: ``field``) setting one field."""
    return Flag(dest or field, ((part, field),), **convert)


class _ConfigAction(argparse.Action):
    """Stores its value and makes the flags a file can give optional: they are checked once
    the file is read (:func:`missing_required`)."""

    def __init__(self, *args: Any, file_gives: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.file_gives = tuple(file_gives)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        for action in parser._actions:
            if action.dest in self.file_gives:
                action.required = False


def add_config_arguments(p: argparse.ArgumentParser, file_gives: Sequence[str], what: str) -> None:
    """Add ``--config FILE`` and ``--print-config`` to ``p`` and record, on the parsed namespace,
    which of its other flags the command line gives (:func:`given`).

    Args:
        p: the command's parser, every other flag already added.
        file_gives: dests of required flags a config file may give instead.
        what: the file's sections, for the help.
    """
    g = p.add_argument_group("configuration file")
    g.add_argument(
        "--config",
        action=_ConfigAction,
        file_gives=file_gives,
        default=None,
        metavar="FILE",
        help=f"read the options from this TOML file ({what}; each key is an option's name as "
        "the Python API spells it); flags given beside it win",
    )
    g.add_argument(
        "--print-config",
        action=_ConfigAction,
        file_gives=file_gives,
        nargs=0,
        default=False,
        help="print the options as a TOML file (--config and the flags merged; feed it back with "
        "--config) and exit",
    )
    record_given_flags(p)


def record_given_flags(p: argparse.ArgumentParser) -> None:
    """Make ``p``'s flags record, on the parsed namespace, which ones the command line gives
    and how it spells each (:func:`given`, :func:`flags_named`); every flag already added."""
    for action in p._actions:
        if action.option_strings and action.dest not in ("help", *CLI_ONLY_DESTS):
            action.__class__ = _recording(type(action))


_RECORDING: dict[type[argparse.Action], type[argparse.Action]] = {}


def _recording(cls: type[argparse.Action]) -> type[argparse.Action]:
    """``cls`` that also adds its dest to the namespace's given flags when the command line
    uses it (one subclass per action class)."""
    if cls in _RECORDING:
        return _RECORDING[cls]

    def __call__(
        self: argparse.Action,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        seen = getattr(namespace, _GIVEN, None)
        if seen is None:
            seen = set()
            setattr(namespace, _GIVEN, seen)
            setattr(namespace, _TYPED, {})
        seen.add(self.dest)
        getattr(namespace, _TYPED)[self.dest] = option_string or self.option_strings[-1]
        cls.__call__(self, parser, namespace, values, option_string)

    sub: type[argparse.Action] = type(cls.__name__, (cls,), {"__call__": __call__})
    _RECORDING[cls] = sub
    return sub


def given(args: argparse.Namespace) -> frozenset[str]:
    """The dests of the flags the command line gave."""
    return frozenset(getattr(args, _GIVEN, ()))


def typed(args: argparse.Namespace) -> dict[str, str]:
    """The flags the command line gave: dest -> the option string as typed."""
    return dict(getattr(args, _TYPED, {}))


_WORD = re.compile(r"(?<![\w./-])[A-Za-z_]\w*(?![\w./-])")
"""A word of a message: an identifier not inside a path or a longer name."""


@contextlib.contextmanager
def flags_named(args: argparse.Namespace, flags: Iterable[Flag]) -> Iterator[None]:
    """Inside, a config's own check refusing a value a flag gave names that flag as the command
    line typed it (``--save-every must be >= 0``), not the field (``save_every``).

    A check's message opens with the field it refuses (:class:`~dapple.files.config_file.
    FieldError`): that word, and any other ``snake_case`` field the message names, is replaced
    by the flag the command line gave for it. A field no flag gave (a ``--config`` file's, a
    default) keeps its name.

    Raises:
        ValidationError: the check's error, renamed.
    """
    from dapple.files.config_file import FieldError

    try:
        yield
    except FieldError as e:
        raise ValidationError(_renamed(str(e), e.part, _flag_names(args, flags))) from None


def _flag_names(args: argparse.Namespace, flags: Iterable[Flag]) -> dict[tuple[str, str], str]:
    """``(part, field) -> the flag as typed``, for the fields of the flags the command line
    gave."""
    spelled = typed(args)
    return {f: spelled[flag.dest] for flag in flags if flag.dest in spelled for f in flag.fields}


def _renamed(message: str, part: str | None, names: Mapping[tuple[str, str], str]) -> str:
    """``message`` with its opening word and its ``snake_case`` words that are fields of
    ``part`` (None: of any part, when one only) named as ``names`` says."""

    def flag_of(word: str) -> str | None:
        hits = {n for (p, f), n in names.items() if f == word and part in (None, p)}
        return hits.pop() if len(hits) == 1 else None

    def swap(m: re.Match[str]) -> str:
        word = m.group(0)
        if m.start() > 0 and "_" not in word:
            return word
        return flag_of(word) or word

    return _WORD.sub(swap, message)


def given_values(args: argparse.Namespace, flags: Iterable[Flag]) -> dict[tuple[str, str], Any]:
    """The config values of the flags the command line gave (``(part, field) -> value``).

    Raises:
        ValidationError: a flag value its converter refuses (named as the flag).
    """
    out: dict[tuple[str, str], Any] = {}
    names = given(args)
    for flag in flags:
        if flag.dest in names:
            out.update(zip(flag.fields, flag.to_fields(getattr(args, flag.dest)), strict=True))
    return out


def parsed_values(args: argparse.Namespace, flags: Iterable[Flag]) -> dict[tuple[str, str], Any]:
    """The config values of every flag of ``flags``, given or defaulted (a command without
    ``--config``, whose flags' defaults are its own).

    Raises:
        ValidationError: a flag value its converter refuses (named as the flag).
    """
    out: dict[tuple[str, str], Any] = {}
    for flag in flags:
        out.update(zip(flag.fields, flag.to_fields(getattr(args, flag.dest)), strict=True))
    return out


def missing_required(
    values: dict[tuple[str, str], Any],
    required: dict[tuple[str, str], str],
    file_key: Callable[[tuple[str, str]], str],
) -> str | None:
    """A message naming the first required field neither a flag nor the file set (None: all
    set)."""
    for f, flag in required.items():
        if values.get(f) is None:
            return f"{flag} is required (or {file_key(f)} in the --config file)"
    return None


@dataclass(frozen=True)
class ConfigFile(Generic[C]):
    """How a command's configuration is read from and written to its ``--config`` file."""

    root: type[C]
    """The dataclass the command's flags and file build."""
    schema: Schema
    """The file's sections and the fields their keys set."""
    load: Callable[[str, dict[tuple[str, str], Any]], C]
    """``load(path, over)``: ``root`` from the file, with the flags' values ``over`` on top."""
    dump: Callable[[C], str]
    """A ``root`` as the TOML file that ``load`` reads back."""
    required: Mapping[tuple[str, str], str]
    """The fields a flag or the file must give, each with its flag's name."""


def config_of(args: argparse.Namespace, flags: Iterable[Flag], file: ConfigFile[C]) -> C | None:
    """The configuration ``--config FILE`` and the flags the command line gave on top (those
    win) ask for (a ``file.root``); with ``--print-config`` that printed as TOML instead (None).

    Raises:
        ValidationError: a bad file or value, or a required field neither a flag nor the file
            gives (named as the flag, and as the file's key).
    """
    from dapple.files.config_file import build, values_of

    flags = tuple(flags)
    over = given_values(args, flags)
    with flags_named(args, flags):
        cfg = build(file.root, over) if args.config is None else file.load(args.config, over)
    if args.print_config:
        print(file.dump(cfg), end="")
        return None
    missing = missing_required(
        values_of(cfg, file.schema),
        dict(file.required),
        lambda f: f"[{_section_of(f, file.schema)}] {f[1]}",
    )
    if missing:
        raise ValidationError(missing)
    return cfg


def _section_of(field: tuple[str, str], schema: Schema) -> str:
    """The section of ``schema`` whose keys include ``field``."""
    return next(section for section, fields in schema.items() if field in fields)
