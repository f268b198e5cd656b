"""Model arguments shared by every command that loads a model: ``-m/--model``, ``--set``,
``--split-at``, ``--weights`` and ``--dynamic-dims``.

``--dynamic-dims`` declares the input dimensions whose size changes from step to step, as the
API's ``dynamic_dims=`` does: ``INPUT:DIM=NAME`` with an optional range ``NAME:MIN..MAX`` (either
end may be left out), or ``INPUT:DIM=static``; ``INPUT`` is a position or a ``forward`` argument
name; items are separated by commas or given in several flags, e.g. ``--dynamic-dims
input_ids:1=seq:2..512,attention_mask:1=seq``.

Torch-free at import time, so building the CLI parser does not load torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dapple.errors import ValidationError

__all__ = [
    "add_model_argument",
    "add_model_arguments",
    "model_overrides",
    "parse_dynamic_dims",
    "parse_overrides",
]

_DIM_SYNTAX = "INPUT:DIM=NAME[:MIN..MAX] or INPUT:DIM=static"


def add_model_argument(
    p: argparse.ArgumentParser, default: str | None = None, required: bool | None = None
) -> None:
    """Add ``-m/--model SPEC`` to ``p``: required unless ``default`` is given or ``required``
    is False."""
    p.add_argument(
        "-m",
        "--model",
        required=default is None if required is None else required,
        default=default,
        metavar="SPEC",
        help="zoo name, package.module:factory, file.py:factory or hf:DIR (a Hugging Face "
        "causal LM from DIR/config.json)" + ("" if default is None else " (default %(default)s)"),
    )


def add_model_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    """Add ``-m/--model SPEC`` (required), ``--set KEY=VALUE`` (factory arguments),
    ``--split-at NAME,NAME``, ``--weights PATH`` and ``--dynamic-dims SPEC`` to ``p`` (``-m``
    optional when not ``required``)."""
    add_model_argument(p, required=required)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model factory argument, e.g. --set layers=8 --set hidden=128 (repeatable)",
    )
    p.add_argument(
        "--split-at",
        metavar="NAME,NAME",
        help="cut the model before these modules (default: before every block of its largest "
        "ModuleList and after the last one)",
    )
    p.add_argument(
        "--weights",
        metavar="PATH",
        help="pretrained weights: a Hugging Face directory (model.safetensors, sharded "
        "safetensors with their index, pytorch_model.bin), a .safetensors file or a state_dict "
        "file; each rank reads only its own stage's tensors",
    )
    p.add_argument(
        "--dynamic-dims",
        action="append",
        default=[],
        metavar="SPEC",
        help="input dimensions whose size changes from step to step: INPUT:DIM=NAME, with an "
        "optional range NAME:MIN..MAX, or INPUT:DIM=static (INPUT a position or forward "
        "argument name; comma-separated or repeated), e.g. input_ids:1=seq:2..512; "
        "dimensions that differ between the first batches are found without it",
    )


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["layers=8", "width=0.5"]`` -> ``{"layers": 8, "width": 0.5}`` (JSON values, else str).

    Raises:
        ValidationError: an item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValidationError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _parse_dim(item: str) -> tuple[str | int, int, str | tuple[str, int, int | None] | None]:
    """One ``INPUT:DIM=VALUE`` item (see the module docstring)."""
    where, sep, value = item.partition("=")
    inp, colon, dim = where.rpartition(":")
    if not sep or not colon or not inp or not value:
        raise ValidationError(f"--dynamic-dims expects {_DIM_SYNTAX}, got {item!r}")
    if not dim.isdigit():
        raise ValidationError(f"--dynamic-dims {item!r}: dimension {dim!r} is not a number")
    key: str | int = int(inp) if inp.isdigit() else inp
    if value == "static":
        return key, int(dim), None
    name, colon, span = value.partition(":")
    if not name:
        raise ValidationError(f"--dynamic-dims {item!r}: the dimension needs a name")
    if not colon:
        return key, int(dim), name
    lo, dots, hi = span.partition("..")
    if not dots or not (lo == "" or lo.isdigit()) or not (hi == "" or hi.isdigit()):
        raise ValidationError(
            f"--dynamic-dims {item!r}: the range must be MIN..MAX (whole numbers; either may "
            f"be left out), got {span!r}"
        )
    return key, int(dim), (name, int(lo) if lo else 1, int(hi) if hi else None)


def parse_dynamic_dims(
    items: list[str],
) -> dict[str | int, dict[int, str | tuple[str, int, int | None] | None]]:
    """``["input_ids:1=seq:2..512,mask:1=seq", "0:2=static"]`` -> the API's ``dynamic_dims``
    (``{"input_ids": {1: ("seq", 2, 512)}, "mask": {1: "seq"}, 0: {2: None}}``).

    Raises:
        ValidationError: an item that is not ``INPUT:DIM=NAME[:MIN..MAX]`` or
            ``INPUT:DIM=static``, or one dimension declared twice.
    """
    out: dict[str | int, dict[int, str | tuple[str, int, int | None] | None]] = {}
    for group in items:
        for item in (x.strip() for x in group.split(",")):
            if not item:
                continue
            key, dim, value = _parse_dim(item)
            if dim in out.get(key, {}):
                raise ValidationError(
                    f"--dynamic-dims declares input {key!r} dimension {dim} twice"
                )
            out.setdefault(key, {})[dim] = value
    return out


def _checked_weights(path: str) -> str:
    """``--weights PATH`` when it names a directory or a non-empty file: checked here, before
    any worker starts (the weights themselves are read as the model loads).

    Raises:
        ValidationError: a missing path, an empty file or an empty directory.
    """
    p = Path(path)
    if not p.exists():
        raise ValidationError(f"--weights {path!r}: no such file or directory")
    if p.is_file() and p.stat().st_size == 0:
        raise ValidationError(f"--weights {path!r} is an empty file")
    if p.is_dir() and not any(p.iterdir()):
        raise ValidationError(f"--weights {path!r} is an empty directory")
    return path


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``load_workload`` from ``--set``, ``--split-at``, ``--weights`` and
    ``--dynamic-dims``.

    Raises:
        ValidationError: a ``--set`` item without ``=``, a bad ``--dynamic-dims`` item, a
            missing or empty ``--weights``.
    """
    from dapple.models.split import parse_split_at

    out = parse_overrides(args.set)
    names = parse_split_at(getattr(args, "split_at", None))
    if names:
        out["split_at"] = names
    if getattr(args, "weights", None):
        out["weights"] = _checked_weights(args.weights)
    dims = parse_dynamic_dims(getattr(args, "dynamic_dims", None) or [])
    if dims:
        out["dynamic_dims"] = dims
    return out
