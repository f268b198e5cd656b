"""Global batches from a map-style dataset, as the runtime consumes them.

A rank of a plan needs only some rows of each global batch: stage-0 replicas the inputs of
their split-concat slices, last-stage replicas the targets of theirs, middle stages nothing
(:mod:`dapple.runtime.stage`). :class:`BatchSource` therefore reads only the items of the rows
it is given and leaves the other rows zero - the shapes are always the global batch's ``G``
rows, so every rank slices the batch exactly as with ``Workload.make_batch``.

Design choices:
    - an item is ``(inputs, targets)``; ``inputs`` a tensor or a tuple/list of tensors, all
      items of one shape (item 0 is the template), unless the dataset makes its batches itself
      (a ``read_rows`` method: padded documents, :mod:`dapple.datasets.packing`);
    - :meth:`BatchSource.batch` hands out step ``t`` and starts reading step ``t + 1`` on one
      background thread, so the read overlaps step ``t``'s compute;
    - :class:`EvalBatches` is the fixed evaluation set: batch ``k`` is items
      ``[k*G, (k+1)*G)`` in file order (no shuffle), the same at every evaluation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import Dataset

from dapple.datasets.sampler import EpochSampler
from dapple.errors import ValidationError

__all__ = ["Batch", "BatchSource", "EvalBatches", "read_rows"]

Batch = tuple[Any, torch.Tensor]
"""``(inputs, targets)`` of ``G`` rows; ``inputs`` a tensor or a tuple of tensors."""


def _tensors(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def read_rows(
    dataset: Dataset[Any],
    items: Sequence[int],
    input_rows: Sequence[int],
    target_rows: Sequence[int],
) -> Batch:
    """The batch whose row ``r`` is item ``items[r]``, read only where needed.

    Args:
        dataset: items ``(inputs, targets)``.
        items: one item index per row (``G`` of them).
        input_rows: rows whose inputs are read (the others stay zero).
        target_rows: rows whose targets are read (the others stay zero).

    A dataset with a ``read_rows(items, input_rows, target_rows)`` method makes its batches
    itself (:class:`~dapple.datasets.packing.PaddedDocuments` pads them to their longest).
    """
    own = getattr(dataset, "read_rows", None)
    if own is not None:
        return own(items, input_rows, target_rows)  # type: ignore[no-any-return]
    template_x, template_y = dataset[0]
    xs = [torch.zeros((len(items), *t.shape), dtype=t.dtype) for t in _tensors(template_x)]
    y = torch.zeros((len(items), *template_y.shape), dtype=template_y.dtype)
    want_x, want_y = set(input_rows), set(target_rows)
    for r in sorted(want_x | want_y):
        ix, iy = dataset[items[r]]
        if r in want_x:
            for dst, src in zip(xs, _tensors(ix), strict=True):
                dst[r] = src
        if r in want_y:
            y[r] = iy
    inputs: Any = tuple(xs) if isinstance(template_x, (tuple, list)) else xs[0]
    return inputs, y


class BatchSource:
    """Step ``t`` -> its global batch from :class:`EpochSampler`, next step prefetched.

    Args:
        dataset: items ``(inputs, targets)``.
        global_batch_size: ``G``.
        seed: the sampler's seed.
        input_rows: rows whose inputs this rank reads.
        target_rows: rows whose targets this rank reads.
        prefetch: read step ``t + 1`` in the background after handing out step ``t``.
        stop: no prefetch of this step or later ones (the run's step count; None: always).

    Raises:
        ValidationError: fewer items than one global batch.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        global_batch_size: int,
        seed: int,
        input_rows: Sequence[int],
        target_rows: Sequence[int],
        *,
        prefetch: bool = True,
        stop: int | None = None,
    ) -> None:
        self.dataset, self.stop = dataset, stop
        self.sampler = EpochSampler(len(dataset), global_batch_size, seed)  # type: ignore[arg-type]
        self.input_rows, self.target_rows = list(input_rows), list(target_rows)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, "dapple-data") if prefetch else None
        self._next: tuple[int, Future[Batch]] | None = None

    def _read(self, step: int) -> Batch:
        with self._lock:  # the sampler caches one permutation; one reader at a time
            items = self.sampler.indices(step)
            return read_rows(self.dataset, items, self.input_rows, self.target_rows)

    def batch(self, step: int) -> Batch:
        """Step ``step``'s global batch (``G`` rows; rows this rank does not read are zero)."""
        pending, self._next = self._next, None
        if pending is not None and pending[0] == step:
            out = pending[1].result()
        else:
            if pending is not None:
                pending[1].cancel()
            out = self._read(step)
        if self._pool is not None and (self.stop is None or step + 1 < self.stop):
            self._next = (step + 1, self._pool.submit(self._read, step + 1))
        return out

    def close(self) -> None:
        """Stop the prefetch thread (an in-flight read finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._next = None


class EvalBatches:
    """The fixed evaluation batches: batch ``k`` is items ``[k*G, (k+1)*G)`` in order.

    Args:
        dataset: items ``(inputs, targets)``.
        global_batch_size: ``G``.
        input_rows: rows whose inputs this rank reads.
        target_rows: rows whose targets this rank reads.

    Raises:
        ValidationError: fewer items than one global batch.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        global_batch_size: int,
        input_rows: Sequence[int],
        target_rows: Sequence[int],
    ) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        if n < global_batch_size:
            raise ValidationError(
                f"evaluation data: {n} items are fewer than one global batch of {global_batch_size}"
            )
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.num_batches = n // global_batch_size
        """Whole batches in the evaluation set."""
        self._read: Callable[[Sequence[int]], Batch] = lambda items: read_rows(
            dataset, items, input_rows, target_rows
        )

    def batch(self, k: int) -> Batch:
        """Evaluation batch ``k`` (``0 <= k < num_batches``).

        Raises:
            ValidationError: ``k`` out of range.
        """
        if not 0 <= k < self.num_batches:
            raise ValidationError(
                f"evaluation batch {k} out of range: the set has {self.num_batches} batches "
                f"of {self.global_batch_size}"
            )
        G = self.global_batch_size
        return self._read(range(k * G, (k + 1) * G))
