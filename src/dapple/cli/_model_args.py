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
from typing import TYPE_CHECKING, Any

from dapple.errors import ValidationError

if TYPE_CHECKING:
    from dapple.api.run_config import ModelConfig

__all__ = [
    "add_model_argument",
    "add_model_arguments",
    "model_config",
    "parse_overrides",
]


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


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The :class:`~dapple.api.run_config.ModelConfig` of ``-m``, ``--set``, ``--split-at``,
    ``--weights`` and ``--dynamic-dims`` (the flags :func:`add_model_arguments` adds).

    Raises:
        ValidationError: a ``--set`` item without ``=``.
    """
    from dapple.api.run_config import ModelConfig

    split_at = getattr(args, "split_at", None) or ""
    return ModelConfig(
        spec=args.model,
        set=parse_overrides(args.set),
        split_at=tuple(t.strip() for t in split_at.split(",") if t.strip()),
        weights=getattr(args, "weights", None),
        dynamic_dims=tuple(getattr(args, "dynamic_dims", None) or ()),
    )
