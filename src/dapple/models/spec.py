"""Model specs: load a :class:`Workload` from a zoo name, ``package.module:factory`` or
``path/to/file.py:factory``, as one that pickles as its spec.

Spawned worker processes unpickle such a workload by loading the spec again, so models defined
in a ``file.py`` train and verify like installed ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapple.models.workload import Workload
from dapple.models.zoo import load_workload
from dapple.models.zoo.loader import HF_PREFIX

__all__ = ["load"]


def _load_spec(spec: str, overrides: dict[str, Any]) -> Workload:
    """Unpickling hook of :class:`_SpecWorkload`: load the spec again in this process."""
    return load(spec, **overrides)


class _SpecWorkload(Workload):
    """A :class:`Workload` that remembers the spec it was loaded from and pickles as it."""

    _spec: tuple[str, dict[str, Any]] | None = None

    def __reduce__(self) -> str | tuple[Any, ...]:
        if self._spec is None:  # e.g. made by dataclasses.replace: pickle the fields
            return super().__reduce__()
        return (_load_spec, self._spec)


def _absolute_spec(spec: str) -> str:
    """``file.py:factory`` and ``hf:DIR`` with absolute paths, so workers in another directory
    find them."""
    if spec.startswith(HF_PREFIX):
        return HF_PREFIX + str(Path(spec[len(HF_PREFIX) :]).resolve())
    module, sep, attr = spec.rpartition(":")
    if sep and (module.endswith(".py") or "/" in module or "\\" in module):
        return f"{Path(module).resolve()}:{attr}"
    return spec


def load(spec: str, *, input_shape: Sequence[int] | None = None, **overrides: Any) -> Workload:
    """Load a workload from a spec, e.g. ``load("dapple.models.hf:gpt2", layers=2, split_at=[...])``.

    The result pickles as ``(spec, overrides)``: a spawned worker loads it again (a
    ``file.py`` model need not be importable there).

    Args:
        spec: A zoo name, ``package.module:factory``, ``path/to/file.py:factory`` or
            ``hf:DIR`` (a Hugging Face causal LM from a local ``config.json``).
        input_shape: Per-sample input shape for factories returning an ``nn.Sequential``.
        **overrides: Keyword arguments of the factory (sizes, ``split_at``); ``weights``: a
            directory or file of pretrained weights for a model traced from an ``nn.Module``;
            ``dynamic_dims``: input dimensions declared dynamic or static on top of the
            model's own, e.g. ``{"input_ids": {1: ("seq", 2, 512)}}``
            (:func:`dapple.models.split.with_dynamic_dims`).

    Raises:
        ValidationError: Unknown name, import failure, bad overrides or factory result; weights
            that lack a parameter or do not fit it.
    """
    spec = _absolute_spec(spec)
    if overrides.get("weights") is not None:
        overrides["weights"] = str(Path(overrides["weights"]).resolve())
    wl = load_workload(spec, input_shape=input_shape, **overrides)
    out = _SpecWorkload(**{f.name: getattr(wl, f.name) for f in dataclasses.fields(Workload)})
    extra = dict(overrides)
    if input_shape is not None:
        extra["input_shape"] = tuple(input_shape)
    object.__setattr__(out, "_spec", (spec, extra))
    return out
