"""An emulated slower device: ``DAPPLE_SLOWDOWN`` makes chosen ranks compute k times slower.

Emulates a cluster of mixed devices (issue #43) on one machine: the compute of a rank listed
in ``DAPPLE_SLOWDOWN="RANK:K[,RANK:K...]"`` (e.g. ``"1:3"``: rank 1 at a third of the speed)
sleeps ``(K - 1)`` times the compute of each of its forwards and backwards (``F``, ``B``,
``I``, ``W``) right after it, so the rank takes K times as long while its cores stay free for
the other ranks (unlike sharing a core, whose cost depends on what the other process runs at
the time). The compute is the CPU time of the computing thread (``time.thread_time``, one
intra-op thread per worker here): a wait inside a backward (a gradient bucket's collective)
or time the process spent descheduled is not multiplied. On CUDA it is the wall time between
two synchronisations of the stream. Only the compute is slowed: sends, receives and
collectives are not. Unset (the default): no slow-down. The variable is read when a worker
builds its stages: set it before the run's workers start.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

from dapple.errors import ValidationError

__all__ = ["SLOWDOWN_ENV", "Slowdown", "slowdown_factor"]

SLOWDOWN_ENV = "DAPPLE_SLOWDOWN"
_NOTHING = contextlib.nullcontext()
"""What an unslowed rank's compute runs under (reusable)."""


def slowdown_factor(rank: int, spec: str | None = None) -> float:
    """K of ``rank`` in ``spec`` (default: the ``DAPPLE_SLOWDOWN`` variable); 1.0 when unlisted.

    Raises:
        ValidationError: ``spec`` is not ``RANK:K[,RANK:K...]`` with ranks >= 0 and K >= 1
            (the message names the variable and the bad item).
    """
    text = os.environ.get(SLOWDOWN_ENV, "") if spec is None else spec
    out: dict[int, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        r, sep, k = item.partition(":")
        try:
            ok = sep == ":" and int(r) >= 0 and float(k) >= 1.0 and float(k) < float("inf")
        except ValueError:
            ok = False
        if not ok:
            raise ValidationError(
                f"{SLOWDOWN_ENV}={text!r}: {item!r} is not RANK:K with a rank >= 0 and a "
                f"finite K >= 1 (e.g. '1:3', rank 1 three times slower)"
            )
        out[int(r)] = float(k)
    return out.get(rank, 1.0)


class Slowdown:
    """Times a block of compute and sleeps ``(factor - 1)`` times as long after it.

    Args:
        factor: K >= 1 (1: the block runs as it is).
        sync: waits for the device's queued work before each clock read (CUDA), or None.
        clock: the measure of the block's compute; None: the wall clock with ``sync``, else
            the thread's CPU time.
        sleep: the sleep (tests pass fakes with ``clock``).
    """

    def __init__(
        self,
        factor: float,
        sync: Callable[[], None] | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.factor, self._sync, self._sleep = factor, sync, sleep
        self._clock = clock or (time.perf_counter if sync is not None else time.thread_time)

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        """The block's context: a shared no-op at K = 1 (no clock read on the hot path)."""
        return _NOTHING if self.factor == 1.0 else self._slowed()

    @contextlib.contextmanager
    def _slowed(self) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        t0 = self._clock()
        yield
        if self._sync is not None:
            self._sync()
        self._sleep((self.factor - 1.0) * (self._clock() - t0))
