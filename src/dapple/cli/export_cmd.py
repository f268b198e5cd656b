"""``dapple export``: a layer checkpoint as a Hugging Face style directory (safetensors), with
an ``hf:DIR`` model's tokenizer files and ``generation_config.json``."""

from __future__ import annotations

import argparse
import re

from dapple.api.exporting import ExportConfig
from dapple.cli._model_args import add_model_arguments, model_config
from dapple.errors import ValidationError

__all__ = ["export_config_of", "parse_size", "register", "run_config"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS["GIB"] = 2**30


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"200MiB"`` -> 200 * 2**20, ``"1000"`` -> 1000 bytes.

    Raises:
        ValidationError: Not a positive size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text, flags=re.IGNORECASE)
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]) if m else 0
    if size < 1:
        raise ValidationError(f"--max-shard-size expects a size like 5GB or 200MiB, got {text!r}")
    return size


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export",
        help="write a checkpoint's weights as a Hugging Face directory (safetensors, config.json, "
        "an hf:DIR model's tokenizer)",
    )
    p.add_argument(
        "--checkpoint-dir",
        required=True,
        metavar="DIR",
        help="checkpoint root (its newest complete checkpoint) or one step-NNNNNNNN directory",
    )
    p.add_argument(
        "--out-dir", required=True, metavar="DIR", help="directory to create (absent or empty)"
    )
    add_model_arguments(p, required=False)  # the model as on `dapple train`
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard, e.g. 5GB or 200MiB (default %(default)s)",
    )
    p.set_defaults(func=run)


def export_config_of(args: argparse.Namespace) -> ExportConfig:
    """The :class:`ExportConfig` of ``dapple export``'s flags.

    Raises:
        ValidationError: a bad ``--max-shard-size`` or ``--set`` item.
    """
    return ExportConfig(
        checkpoint_dir=args.checkpoint_dir,
        out_dir=args.out_dir,
        max_shard_bytes=parse_size(args.max_shard_size),
        model=model_config(args),
    )


def run(args: argparse.Namespace) -> int:
    return run_config(export_config_of(args))


def run_config(cfg: ExportConfig) -> int:
    """Export what ``cfg`` asks for (:func:`dapple.api.export`) and say what was written
    (``dapple export`` once its flags are read)."""
    from dapple import api

    result = api.export(cfg)
    spec = cfg.model.spec
    print(
        f"exported step {result.step}: {result.num_tensors} tensors, "
        f"{result.total_bytes / 2**20:.1f} MiB in {len(result.files)} files to {result.path}"
        + (
            ""
            if result.config
            else f" (no config.json: {spec!r} is not a Hugging Face model)"
            if spec
            else " (no config.json: give -m for a Hugging Face model)"
        )
    )
    if result.copied:
        print(f"copied from the model's directory: {', '.join(result.copied)}")
    return 0
