"""Pretrained weights on disk, read one tensor at a time.

A :class:`WeightFiles` is a Hugging Face style directory (``model.safetensors``, or shards named
by ``model.safetensors.index.json``, or ``pytorch_model.bin``), a single ``.safetensors`` file,
or a ``state_dict`` saved with ``torch.save``. Safetensors files are opened lazily
(``safetensors.safe_open``): a rank reads only the tensors of its own stage, and the names,
shapes and dtypes are checked against the model from the file headers before any compute.
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dapple.errors import ValidationError, one_line

__all__ = ["WeightFiles"]

log = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_SINGLE = ("model.safetensors", "pytorch_model.bin")


def _safe_open(path: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - safetensors comes with the hf extra
        raise ValidationError("reading .safetensors needs: pip install 'dapple[hf]'") from e
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # a truncated or foreign file
        raise ValidationError(f"cannot read weights file {path}: {one_line(e)}") from e


class WeightFiles:
    """Tensors by name across one or several files (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        """Index the tensors at ``path`` (headers only for safetensors).

        Raises:
            ValidationError: No such path, no weights file in a directory, an unreadable file.
        """
        self.path = Path(path).resolve()
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        self._handles: dict[Path, Any] = {}
        self._state: dict[str, torch.Tensor] | None = None
        for file in self._files():
            if file.suffix == ".safetensors":
                handle = self._handle(file)
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    piece = handle.get_slice(name)
                    self._where[name] = file
                    self._meta[name] = (tuple(piece.get_shape()), str(piece.get_dtype()))
            else:
                self._state = self._load_state_dict(file)
                for name, t in self._state.items():
                    self._where[name] = file
                    self._meta[name] = (tuple(t.shape), str(t.dtype).replace("torch.", ""))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the path: a worker indexes the files again."""
        return (WeightFiles, (str(self.path),))

    def _files(self) -> list[Path]:
        p = self.path
        if p.is_file():
            return [p]
        if not p.is_dir():
            raise ValidationError(f"weights path {p} does not exist")
        if (p / _INDEX).is_file():
            try:
                shards = sorted(set(json.loads((p / _INDEX).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise ValidationError(f"bad weights index {p / _INDEX}: {e}") from e
            missing = [s for s in shards if not (p / s).is_file()]
            if missing:
                raise ValidationError(f"{p / _INDEX} names missing shards {missing}")
            return [p / s for s in shards]
        for name in _SINGLE:
            if (p / name).is_file():
                return [p / name]
        found = sorted(f.name for f in p.glob("*.safetensors"))
        if len(found) == 1:
            return [p / found[0]]
        raise ValidationError(
            f"no weights in {p}: expected {_INDEX}, {' or '.join(_SINGLE)}"
            + (f" (found {found})" if found else "")
        )

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = _safe_open(file)
        return self._handles[file]

    @staticmethod
    def _load_state_dict(file: Path) -> dict[str, torch.Tensor]:
        if not zipfile.is_zipfile(file):  # what torch.save writes (and torch.load mmaps)
            raise ValidationError(
                f"weights file {file} is neither safetensors (name it .safetensors) nor a "
                "torch.save state_dict"
            )
        try:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise ValidationError(f"cannot read weights file {file}: {one_line(e)}") from e
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise ValidationError(f"{file} is not a state_dict (name -> tensor)")
        return state

    def names(self) -> set[str]:
        """Every tensor name in the files."""
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` (from disk for safetensors)."""
        if self._state is not None and name in self._state:
            return self._state[name]
        return self._handle(self._where[name]).get_tensor(name)  # type: ignore[no-any-return]

    def key_for(self, aliases: list[str]) -> str | None:
        """The first of a parameter's names (tied parameters have several) in the files."""
        return next((n for n in aliases if n in self._where), None)

    def check(self, model: nn.Module) -> dict[str, str]:
        """Match every parameter of ``model`` (meta or real) to a tensor in the files.

        Returns:
            Each parameter name (aliases included) -> its tensor's name in the files.

        Raises:
            ValidationError: A parameter without a tensor, a shape mismatch, or a dtype the
                parameter cannot take (an integer tensor for a floating parameter).
        """
        groups: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
            params[id(p)] = p
        keys: dict[str, str] = {}
        missing: list[str] = []
        for pid, aliases in groups.items():
            key = self.key_for(aliases)
            if key is None:
                missing.append(aliases[0])
                continue
            p = params[pid]
            shape, dtype = self._meta[key]
            where = self._where[key]
            if shape != tuple(p.shape):
                raise ValidationError(
                    f"weights tensor {key!r} in {where} has shape {list(shape)}, the model's "
                    f"parameter {aliases[0]!r} has {list(p.shape)}"
                )
            if p.is_floating_point() != _floating(dtype):
                raise ValidationError(
                    f"weights tensor {key!r} in {where} is {dtype}; parameter {aliases[0]!r} "
                    f"is {str(p.dtype).replace('torch.', '')}"
                )
            keys.update(dict.fromkeys(aliases, key))
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValidationError(f"weights in {self.path} lack tensors {shown}{more}")
        unused = self.names() - set(keys.values())
        if unused:
            log.info("%d tensors in %s are not parameters: %s", len(unused), self.path, unused)
        return keys


def _floating(dtype: str) -> bool:
    return dtype.lower().replace("torch.", "") in {
        "f16",
        "bf16",
        "f32",
        "f64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "f8_e4m3",
        "f8_e5m2",
        "float8_e4m3fn",
        "float8_e5m2",
    }
