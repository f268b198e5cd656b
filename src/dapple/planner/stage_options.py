"""A stage's options under each zero mode, and the scorer's choice among them for its K_i.

The :class:`~dapple.planner.scorer.Scorer` costs a stage ``(layers, devices, b)`` under each
:class:`ZeroMode` it may pick (unsharded first): F, B, AR_s + U_s, D without and with
re-computation (:class:`StageOption`). A stage holding its K_i micro-batches in flight
unsharded, without re-computation, takes that mode and never looks at the others, so
:class:`LazyOptions` costs each mode only when first read. :func:`stage_choice` picks a
stage's mode (:func:`pick_zero_mode`), re-computation and D. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, overload

from dapple.cost.terms import StageTerms
from dapple.planner.zero_modes import UNSHARDED, ZeroMode

__all__ = ["LazyOptions", "StageOption", "StageOptions", "pick_zero_mode", "stage_choice"]


class StageOption(NamedTuple):
    """A cached stage under one :class:`ZeroMode`: F, B (without re-computation), AR_s + U_s, D
    without and with re-computation, and the stage's :class:`StageTerms` either way."""

    f: float
    bw: float
    ar: float
    d_nr: int
    d_r: int
    plain: StageTerms
    recomputed: StageTerms
    floor: float = 0.0
    """Bytes below the step peak of this stage and of any longer one on the same devices,
    with or without re-computation (:meth:`Scorer._options
    <dapple.planner.scorer.Scorer._options>`)."""
    traffic: float = 0.0
    """Per-step traffic inside F and B: ZeRO-3's gathers per micro-batch (M x their time)."""


StageOptions = Sequence[tuple[ZeroMode, StageOption]]
"""What :meth:`Scorer.stage_options <dapple.planner.scorer.Scorer.stage_options>` offers
one stage: ``(zero mode, terms)``, unsharded first."""


class LazyOptions(Sequence[tuple[ZeroMode, StageOption]]):
    """:data:`StageOptions` of the modes ``modes``, each costed by ``make(mode)`` when first
    read and then kept: the same values as costing them all at once."""

    __slots__ = ("_got", "_make", "_modes")

    def __init__(self, modes: Sequence[ZeroMode], make: Callable[[ZeroMode], StageOption]) -> None:
        self._modes = tuple(modes)
        self._make = make
        self._got: list[StageOption | None] = [None] * len(self._modes)

    def __len__(self) -> int:
        return len(self._modes)

    @overload
    def __getitem__(self, i: int) -> tuple[ZeroMode, StageOption]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[ZeroMode, StageOption]]: ...

    def __getitem__(
        self, i: int | slice
    ) -> tuple[ZeroMode, StageOption] | Sequence[tuple[ZeroMode, StageOption]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._modes)))]
        mode = self._modes[i]  # IndexError past the end, as a list
        got = self._got[i]
        if got is None:
            got = self._got[i] = self._make(mode)
        return mode, got

    def __iter__(self) -> Iterator[tuple[ZeroMode, StageOption]]:
        for i in range(len(self._modes)):
            yield self[i]


def stage_choice(
    options: StageOptions, k: int, M: int, bounded: bool, recompute: bool | None = None
) -> tuple[ZeroMode, StageOption, bool, int] | None:
    """A stage's zero mode (:func:`pick_zero_mode`), re-computation and D when it keeps k
    micro-batches in flight: ``(mode, its terms, re-computes, D)``, or None when it cannot hold
    them (D < 1, or D < k under a schedule that does not bound stages by K_i). Re-computes only
    when memory demands it, unless ``recompute`` forces it either way."""
    z, r = options[0]
    if z != UNSHARDED or r.d_nr < k:  # not pick_zero_mode's first case (unsharded holds k)
        z, r = pick_zero_mode(options, k, M)
    d_nr, d_r = r.d_nr, r.d_r
    use_r = d_nr < k and (d_r >= k or d_r > d_nr) if recompute is None else recompute
    d = d_r if use_r else d_nr
    if d < 1 or (not bounded and d < k):
        return None
    return z, r, use_r, d


def pick_zero_mode(options: StageOptions, k: int, M: int) -> tuple[ZeroMode, StageOption]:
    """The zero mode of a stage holding k micro-batches in flight: unsharded when it holds k
    without re-computation (ZeRO's 1/r_s update in AR_s + U_s does not buy a shard where memory
    does not ask for one); else, of the options that hold k (without re-computation, or with it
    at M more forward passes F), the one with the least AR_s + U_s (+ M F), the lower zero stage
    on ties; none holds k: the one with the most room.

    Args:
        options: ``(zero mode, (F, B, AR, D without re-computation, D with, ...))``, zero
            stage ascending (:class:`StageOption`).
    """
    if options[0][0] == UNSHARDED and options[0][1].d_nr >= k:
        return options[0]
    best: tuple[float, ZeroMode, StageOption] | None = None
    for z, r in options:
        base = r.ar + r.traffic  # ZeRO-3's per-micro-batch gathers count as traffic
        cost = base if r.d_nr >= k else base + M * r.f if r.d_r >= k else None
        if cost is not None and (best is None or cost < best[0]):
            best = (cost, z, r)
    if best is None:
        return options[-1]
    return best[1], best[2]
