"""Peak held-activation meter: bytes of tensors kept alive for backward, per device (CPU metric).

On CUDA the runtime reports ``torch.cuda.max_memory_allocated``; on CPU there is no allocator
counter, so :class:`ActivationMeter` counts what a pipeline stage *holds* between a forward and
its backward: every tensor autograd saves for backward (via
``torch.autograd.graph.saved_tensors_hooks``) plus the boundary activations the runtime keeps
(received stage inputs, stage outputs awaiting their gradient). Tensors are counted once per
underlying storage (shared views are not double counted) and parameter storages are excluded.
With re-computation the checkpoint's own hooks hide the inner saved tensors, so only the stage
inputs count - exactly what re-computation keeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ActivationMeter", "Held"]


class Held:
    """A counted reference to a tensor; releasing it (or garbage collection) uncounts it."""

    __slots__ = ("_key", "_meter", "tensor")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor) -> None:
        self._meter: ActivationMeter | None = meter
        self.tensor = tensor
        storage = tensor.untyped_storage()
        self._key = (storage.data_ptr(), storage.nbytes())
        meter._inc(self._key)

    def release(self) -> None:
        if self._meter is not None:
            self._meter._dec(self._key)
            self._meter = None

    def __del__(self) -> None:
        self.release()


def _storage_ptr(t: torch.Tensor) -> int:
    """Where ``t``'s storage lives (a ZeRO-3 DTensor: its local shard's); -1 (not metered):
    a tensor without a real storage (FSDP's unsharded parameters, a tensor subclass)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return -1


class ActivationMeter:
    """Counts held activation bytes (deduplicated by storage) and records the peak."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._refs: dict[tuple[int, int], int] = {}
        self._exclude = {_storage_ptr(t) for t in exclude} | {-1}  # -1: no real storage
        self.current_bytes = 0
        self.peak_bytes = 0

    def _inc(self, key: tuple[int, int]) -> None:
        n = self._refs.get(key, 0)
        self._refs[key] = n + 1
        if n == 0:
            self.current_bytes += key[1]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _dec(self, key: tuple[int, int]) -> None:
        n = self._refs[key] - 1
        if n == 0:
            del self._refs[key]
            self.current_bytes -= key[1]
        else:
            self._refs[key] = n

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def hold(self, tensors: Iterable[Any]) -> list[Held]:
        """Count the tensors among ``tensors`` until the returned handles are released."""
        return [
            Held(self, t)
            for t in tensors
            if isinstance(t, torch.Tensor) and _storage_ptr(t) not in self._exclude
        ]

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context manager counting every tensor autograd saves for backward inside it."""

        def pack(t: torch.Tensor) -> Any:
            if t.device.type == "meta" or _storage_ptr(t) in self._exclude:
                return t
            return Held(self, t)

        def unpack(h: Any) -> torch.Tensor:
            return h.tensor if isinstance(h, Held) else h

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
