"""Which items make step ``t``'s global batch: a seeded permutation per epoch, G at a time.

Design choices:
    - ``N`` items, global batch ``G``: an epoch is ``E = N // G`` steps; step ``t`` is step
      ``k = t mod E`` of epoch ``e = t // E`` and takes items ``perm_e[k*G : (k+1)*G]``, where
      ``perm_e`` is the permutation of ``range(N)`` drawn by NumPy's PCG64 from
      ``SeedSequence([seed, e])``;
    - the ``N mod G`` items at the end of each epoch's permutation are dropped (each epoch
      drops other ones), so every step has exactly ``G`` distinct items and no step spans
      two epochs;
    - the position is a pure function of ``(seed, t, G, N)``: a run resumed at step ``t``
      reads exactly the batch an uninterrupted run reads at step ``t``, whatever plan either
      runs under. Nothing but the step index needs saving (NumPy keeps a seeded ``Generator``'s
      stream across releases in practice but does not promise it: resume under the NumPy the
      run started with).
"""

from __future__ import annotations

import numpy as np

from dapple.errors import ValidationError

__all__ = ["EpochSampler"]


class EpochSampler:
    """Step -> item indices of its global batch (see the module docstring).

    Args:
        num_items: ``N``, the dataset's length.
        global_batch_size: ``G``, items per step.
        seed: seeds every epoch's permutation.

    Raises:
        ValidationError: ``G < 1`` or fewer than ``G`` items.
    """

    def __init__(self, num_items: int, global_batch_size: int, seed: int) -> None:
        if global_batch_size < 1:
            raise ValidationError(f"global batch size must be >= 1, got {global_batch_size}")
        if num_items < global_batch_size:
            raise ValidationError(
                f"{num_items} items are fewer than one global batch of {global_batch_size}"
            )
        self.num_items, self.global_batch_size, self.seed = num_items, global_batch_size, seed
        self.steps_per_epoch = num_items // global_batch_size
        """``E = N // G``: steps per epoch (the remainder of each epoch is dropped)."""
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, step within the epoch)`` of step ``step``."""
        if step < 0:
            raise ValidationError(f"step must be >= 0, got {step}")
        return divmod(step, self.steps_per_epoch)

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of all ``N`` items (the last one is cached)."""
        if epoch != self._epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perm = rng.permutation(self.num_items)
            self._epoch = epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        """The ``G`` item indices of step ``step``'s global batch, in row order."""
        e, k = self.position(step)
        G = self.global_batch_size
        return [int(i) for i in self.permutation(e)[k * G : (k + 1) * G]]
