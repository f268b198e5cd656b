"""Peak held-activation meter: bytes of tensors kept alive for backward, per device (CPU metric).

On CUDA the runtime reports ``torch.cuda.max_memory_allocated``; on CPU there is no allocator
counter, so :class:`ActivationMeter` counts what a pipeline stage *holds* between a forward and
its backward: every tensor autograd saves for backward (via
``torch.autograd.graph.saved_tensors_hooks``) plus the boundary activations the runtime keeps
(received stage inputs, stage outputs awaiting their gradient). Tensors are counted once per
underlying storage (shared views are not double counted) and parameter storages are excluded:
the stage's own, and under ZeRO-3 the whole parameters FSDP gathers for a forward and keeps
for its backward (they are parameters, not activations).
With re-computation the checkpoint's own hooks hide the inner saved tensors, so only the stage
inputs count - exactly what re-computation keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
    """Counts held activation bytes (deduplicated by storage) and records the peak.

    Args:
        exclude: Parameters never counted (their storages).
        gathered: Under ZeRO-3, the stage's parameters as they are now (FSDP swaps in the whole
            parameters it gathers before a forward); their storages are not counted either,
            looked up at each tensor saved. None: no parameter changes storage.
    """

    def __init__(
        self,
        exclude: Iterable[torch.Tensor] = (),
        gathered: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        self._refs: dict[tuple[int, int], int] = {}
        self._exclude = {_storage_ptr(t) for t in exclude} | {-1}  # -1: no real storage
        self._gathered = gathered
        self.current_bytes = 0
        self.peak_bytes = 0

    def _excluded(self, t: torch.Tensor) -> bool:
        """``t`` is a parameter's storage (the stage's own, or a whole one FSDP gathered)."""
        ptr = _storage_ptr(t)
        if ptr in self._exclude:
            return True
        return self._gathered is not None and any(_storage_ptr(p) == ptr for p in self._gathered())

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
            Held(self, t) for t in tensors if isinstance(t, torch.Tensor) and not self._excluded(t)
        ]

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context manager counting every tensor autograd saves for backward inside it."""

        def pack(t: torch.Tensor) -> Any:
            if t.device.type == "meta" or self._excluded(t):
                return t
            return Held(self, t)

        def unpack(h: Any) -> torch.Tensor:
            return h.tensor if isinstance(h, Held) else h

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
