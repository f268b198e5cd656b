"""L of a local-search round's moves at once, to score exactly only those that may win.

A round of :mod:`dapple.planner.stage_widths` weighs a few hundred moves, each differing
from the current plan in one or two stages: a :data:`Move` ``(i, j, new)`` is the plan
``stages[:i] + new + stages[j:]``. Its stages keep their terms from the current plan (each
stage's choice at its K_i, :func:`~dapple.planner.stage_options.stage_choice`, made once per round
for the current stage count S and, for merges, S - 1), so only the new stages and the comm
stages beside them are looked up. Equations 1-3 then run over all moves as numpy arrays, the
operations of :func:`~dapple.cost.latency.steady_periods` and
:func:`~dapple.cost.latency.latency` in the same order: the periods, the pivot Q and the
warm-up and steady phases equal :meth:`MixedScorer.score
<dapple.planner.stage_widths.MixedScorer.score>`'s bit for bit, the tail's forwards are a
difference of prefix sums (:data:`ROUNDING`). Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from dapple.core.plan import Policy
from dapple.cost.latency import TIE, longest_laps
from dapple.planner.scorer import in_flight
from dapple.planner.stage_options import StageOptions, stage_choice

__all__ = ["ROUNDING", "Move", "Row", "WidthStage", "estimate_moves", "stage_row"]

WidthStage = tuple[int, int, tuple[int, ...], int]
"""``(start, end, devices, t)``: layers ``[start, end)`` on the cluster's devices (replica-major,
r x t of them, each tensor group t consecutive devices starting at a multiple of t) at width t."""

Move = tuple[int, int, tuple[WidthStage, ...]]
"""``(i, j, new)``: the current plan's stages ``[i, j)`` replaced by ``new``."""

ROUNDING = 1e-9
"""Relative bound on how far an estimate may lie from the exact L (the tail's forwards
summed in another order: a few ulps)."""

Row = tuple[float, float, float, int, bool]
"""A stage's terms at its K_i: F, B, AR_s + U_s, D where it binds (0: none), and whether it
cannot hold its K_i (:func:`stage_row`)."""

RowOf = Callable[[WidthStage, int], Row]
Comm = Callable[[WidthStage, WidthStage], float]


class _Columns(NamedTuple):
    """:class:`_Rows` as arrays."""

    F: NDArray[np.float64]
    B: NDArray[np.float64]
    AR: NDArray[np.float64]
    d: NDArray[np.intp]
    bad: NDArray[np.bool_]


class _Rows:
    """Per-stage terms of the stages a round's moves are built of, for one policy: the current
    stages at the current count S (rows ``[0, S)``), those that begin a plan of another count
    at that count, then the moves' new stages. Columns F, B, AR_s + U_s and D where it binds
    (0: none); a row that cannot hold its K_i is marked."""

    def __init__(self) -> None:
        self.F: list[float] = []
        self.B: list[float] = []
        self.AR: list[float] = []
        self.d: list[int] = []
        self.bad: list[bool] = []

    def add(self, row: Row) -> int:
        """The index of a new row."""
        self._append(*row)
        return len(self.F) - 1

    def add_empty(self) -> None:
        """A row of no time and no bound (what leads a shorter plan)."""
        self._append(0.0, 0.0, 0.0, 0, False)

    def arrays(self) -> _Columns:
        """The columns as arrays."""
        return _Columns(
            np.array(self.F), np.array(self.B), np.array(self.AR),
            np.array(self.d, dtype=np.intp), np.array(self.bad, dtype=bool),
        )  # fmt: skip

    def _append(self, f: float, b: float, ar: float, d: int, bad: bool) -> None:
        self.F.append(f)
        self.B.append(b)
        self.AR.append(ar)
        self.d.append(d)
        self.bad.append(bad)


def stage_row(options: StageOptions, k: int, M: int, bounded: bool) -> Row:
    """The :data:`Row` of a stage with these options holding ``k`` micro-batches
    (:func:`~dapple.planner.stage_options.stage_choice`)."""
    got = stage_choice(options, k, M, bounded) if options else None
    if got is None:
        return 0.0, 0.0, 0.0, 0, True
    _, r, use_r, d = got
    t = r.recomputed if use_r else r.plain
    return t.forward_ms, t.backward_ms, t.sync_ms + t.update_ms, d * (d < k), False


def estimate_moves(
    stages: Sequence[WidthStage],
    moves: Sequence[Move],
    M: int,
    row: RowOf,
    comm: Comm,
    schedule: str,
    policies: Sequence[Policy],
) -> list[float]:
    """L of each move's plan within :data:`ROUNDING` (``inf`` where it does not fit), as
    :func:`~dapple.planner.scorer.score_options` scores it on a cluster without host terms,
    under a schedule whose in-flight counts with D are DAPPLE's
    (:func:`~dapple.schedule.early_backward.warmup_counts`, :func:`_in_flight`).

    Args:
        stages: the current plan (S stages).
        moves: each ``(i, j, new)`` (:data:`Move`), ``new`` non-empty.
        M: micro-batches.
        row: a stage's :data:`Row` at this M's b holding k micro-batches (:func:`stage_row`).
        comm: the comm stage between two neighbouring stages at this M's b.
        schedule: the schedule whose in-flight counts K_i apply.
        policies: the warm-up policies to try.
    """
    if not moves:
        return []
    S = len(stages)
    sizes = [S - (j - i) + len(new) for i, j, new in moves]
    heads = {S: S}  # per stage count: how many current stages begin some move's plan
    for (i, _, _), n in zip(moves, sizes, strict=True):
        heads[n] = max(heads.get(n, 0), i)
    base: dict[int, int] = {}  # per stage count: the row of its first current stage
    for n in heads:
        base[n] = sum(heads[x] for x in base)
    comp_idx, comm_idx, comm_src = _layout(stages, moves, sizes, base, comm)
    first_new = sum(heads.values())
    comp_idx = [[first_new - 1 - x if x < 0 else x for x in row] for row in comp_idx]
    new_stages = [st for _, _, new in moves for st in new]
    new_at = [
        (n, i + a) for (i, _, new), n in zip(moves, sizes, strict=True) for a in range(len(new))
    ]
    # every plan right-aligned to the longest, led by empty stages (no time, period 0)
    width = max(sizes)
    pad = [width - n for n in sizes]
    comm_src.append(0.0)
    comp_at = np.array(
        [[-1] * p + row for row, p in zip(comp_idx, pad, strict=True)], dtype=np.intp
    ).reshape(len(moves), width)
    comm_at = np.array(
        [[-1] * p + row for row, p in zip(comm_idx, pad, strict=True)], dtype=np.intp
    ).reshape(len(moves), width - 1)
    comm_ms = np.array(comm_src)[comm_at]
    tables = []
    for policy in policies:
        rows = _Rows()
        nominal = {n: in_flight(schedule, n, M, policy, None) for n in {*heads, width}}
        for n, h in heads.items():
            for a in range(h):
                rows.add(row(stages[a], nominal[n][a]))
        for st, (n, a) in zip(new_stages, new_at, strict=True):
            rows.add(row(st, nominal[n][a]))
        rows.add_empty()
        tables.append((rows.arrays(), nominal[width]))
    cols = _Columns(*(np.concatenate([t[0][f] for t in tables]) for f in range(5)))
    offsets = np.cumsum([0, *(len(t[0].F) for t in tables[:-1])])
    # the last row of each policy's table is its empty stage (index -1)
    idx = np.concatenate([np.where(comp_at < 0, o + len(t[0].F) - 1, comp_at + o)
                          for t, o in zip(tables, offsets, strict=True)])  # fmt: skip
    K = np.repeat(np.array([t[1] for t in tables], dtype=np.intp), len(moves), axis=0)
    L = _latency(
        cols,
        idx,
        np.tile(comm_ms, (len(tables), 1)),
        K,
        np.tile(np.array(pad, dtype=np.intp), len(tables)),
        M,
    )
    return [float(x) for x in L.reshape(len(tables), len(moves)).min(axis=0)]


def _layout(
    stages: Sequence[WidthStage],
    moves: Sequence[Move],
    sizes: Sequence[int],
    base: dict[int, int],
    comm: Comm,
) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Per move its computation stages' rows (-1 - k for its k-th new stage overall) and its
    comm stages' indices into the comm times returned (the current plan's first)."""
    S = len(stages)
    comm_src = [comm(stages[a], stages[a + 1]) for a in range(S - 1)]
    comp_idx: list[list[int]] = []
    comm_idx: list[list[int]] = []
    k = 0
    for (i, j, new), n in zip(moves, sizes, strict=True):
        comp_idx.append(
            [*range(base[n], base[n] + i), *range(-1 - k, -1 - k - len(new), -1), *range(j, S)]
        )
        k += len(new)
        row = list(range(i - 1)) if i else []
        for a in range(len(new) + 1):
            right = new[a] if a < len(new) else (stages[j] if j < S else None)
            if (a > 0 or i > 0) and right is not None:
                row.append(len(comm_src))
                comm_src.append(comm(new[a - 1] if a else stages[i - 1], right))
        comm_idx.append(row + list(range(j, S - 1)))
    return comp_idx, comm_idx, comm_src


def _in_flight(own: NDArray[np.intp], d: NDArray[np.intp]) -> NDArray[np.intp]:
    """K_i per position (rows) of each plan (columns), as
    :func:`~dapple.schedule.early_backward.warmup_counts` makes them: ``own`` (the schedule's
    count at this M) capped by D where it binds (``d > 0``), by the stage before and by the
    share ``ceil(D_s (S-t) / (S-s))`` of the stage s whose own D holds it lowest. Plans are
    right-aligned, so S - t is the row's distance from the end."""
    P, n = own.shape
    K = np.empty_like(own)
    num = np.full(n, np.iinfo(np.intp).max // (2 * P + 2))  # no share yet: no cap
    den = np.ones(n, dtype=np.intp)
    for p in range(P):
        left = P - p
        k = np.where(d[p] > 0, np.minimum(own[p], d[p]), own[p])
        if p:
            k = np.minimum(k, K[p - 1])
        k = np.minimum(k, -(-num * left // den))
        K[p] = k
        binds = (d[p] > 0) & (k == d[p]) & (k < own[p]) & (k * den < num * left)
        num = np.where(binds, k, num)
        den = np.where(binds, left, den)
    return K


def _turn_waits(
    F: NDArray[np.float64], B: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """:func:`~dapple.cost.latency.turn_waits` of each column, at the computation stages."""
    up = np.zeros_like(F[0::2])
    down = np.zeros_like(F[0::2])
    if F.shape[0] >= 5:  # computation stages with comm stages on both sides
        before, here, nxt = B[1:-2:2], F[2:-1:2], F[3::2]
        up[1:-1] = np.where(nxt > 0, np.maximum(0.0, before - here), 0.0)
        down[1:-1] = np.where(before > 0, np.maximum(0.0, nxt - B[2:-1:2]), 0.0)
    return up, down


def _latency(
    rows: _Columns,
    idx: NDArray[np.intp],
    comm: NDArray[np.float64],
    nominal: NDArray[np.intp],
    pad: NDArray[np.intp],
    M: int,
) -> NDArray[np.float64]:
    """L of each plan whose computation stages are ``rows[idx[m]]`` and comm stages
    ``comm[m]``, K_i ``nominal[m]`` without D, led by ``pad[m]`` empty stages (equations
    1-3, module docstring); ``inf`` where a stage does not fit."""
    n, S = idx.shape
    P = 2 * S - 1
    at = idx.T  # position-major: each position's values over the plans are contiguous
    F = np.empty((P, n))
    B = np.empty((P, n))
    AR = np.zeros((P, n))
    F[0::2] = rows.F[at]
    B[0::2] = rows.B[at]
    AR[0::2] = rows.AR[at]
    F[1::2] = comm.T
    B[1::2] = comm.T
    d = rows.d[at]
    K = _in_flight(nominal.T, d)
    fb = F + B
    rt = np.cumsum(fb[::-1], axis=0)[::-1]
    period = fb.copy()
    up, down = _turn_waits(F, B)
    comp = np.maximum(fb[0::2], (rt[0::2] + up) / K)
    if M > 1:
        # steady_periods' cycles turning at a later computation stage, then one division
        after = np.vstack([rt[1::2], np.zeros((1, n))])  # the RT after each computation stage
        longest = longest_laps(K, rt[0::2] + up, after - down, fb[0::2], M)
        comp = np.where(longest > (M - 1) * comp, longest / (M - 1), comp)
    period[0::2] = comp
    period[np.arange(P)[:, None] < 2 * pad[None, :]] = 0.0
    mp = (M - 1) * period
    Q = np.full(n, P - 1)
    mpQ = mp[P - 1].copy()
    between = np.zeros(n)
    paced = np.zeros((P, n), dtype=bool)  # cycle_paced: K_i below M, period above F + B
    paced[0::2] = (K < M) & (period[0::2] > fb[0::2])
    for s in range(P - 2, -1, -1):
        take = mp[s] > mpQ + np.where(paced[s], 0.0, between)
        Q[take] = s
        np.copyto(mpQ, mp[s], where=take)
        between += fb[s]
        between[take] = 0.0
    cols = np.arange(n)
    cumF = np.cumsum(F, axis=0)
    T_w = cumF[Q, cols]
    tail_f = cumF[-1] - T_w
    # latency()'s ending phase: stages after Q from the tail's forwards, those up to Q from
    # the pivot's waits (pivot_waits) and its drain where Q computes at its own pace
    rB = np.vstack([np.cumsum(B[::-1], axis=0)[::-1], np.zeros((1, n))])  # sum_{a>=s} B_a
    chain = rB[:-1] + AR
    rows_at = np.arange(P)[:, None]
    later = rows_at > Q[None, :]
    after = np.maximum(np.max(np.where(later, chain, 0.0), axis=0), 0.0)
    b_after = rB[Q + 1, cols]
    tail = tail_f + b_after
    fQ, bQ = F[Q, cols], B[Q, cols]
    kQ = np.minimum(K[Q // 2, cols], M).astype(np.float64)
    own_pace = (Q % 2 == 0) & (period[Q, cols] == fQ + bQ) & (kQ > 1)
    first = np.where(own_pace, np.maximum(0.0, tail - (kQ - 1) * fQ), 0.0)
    last = np.minimum(tail, first + np.maximum(0.0, tail - (kQ - 1) * bQ))
    last = np.where(own_pace, last, tail)
    drain = np.where(own_pace, kQ - 1, 0.0)
    before = np.where((rows_at < Q[None, :]) & (rows_at % 2 == 0), B, 0.0)
    widest = np.maximum.accumulate(before[::-1], axis=0)[::-1]  # computation stages in [s, Q)
    own = np.maximum(np.max(np.where(later, 0.0, chain - b_after), axis=0), 0.0)
    extra = drain * (widest - bQ)
    queued = np.where(later | (extra <= 0.0), 0.0, chain - b_after + first + extra)
    T_e = np.maximum(np.maximum(tail_f + after, last + own), np.max(queued, axis=0))
    L: NDArray[np.float64] = T_w + mpQ + T_e
    bound = _backward_phases(F, B, AR, K, M, cumF)
    L = np.where(bound > L * (1.0 + TIE), bound, L)
    L[rows.bad[idx].any(axis=1)] = np.inf
    return L


def _backward_phases(
    F: NDArray[np.float64],
    B: NDArray[np.float64],
    AR: NDArray[np.float64],
    K: NDArray[np.intp],
    M: int,
    cumF: NDArray[np.float64],
) -> NDArray[np.float64]:
    """:func:`~dapple.cost.latency.backward_phases` of each plan (columns; rows alternate
    computation and comm stages, ``K`` per computation stage, ``cumF`` F's prefix sums)."""
    k = np.minimum(K, M).astype(np.float64)
    widest = np.maximum.accumulate(F[0::2], axis=0)
    ready = cumF.copy()
    ready[0::2] += (k - 1) * widest
    arrive = cumF - F  # sum_{a<t} F_a
    end = np.zeros(F.shape[1])
    first = np.zeros(F.shape[1])
    last = np.zeros(F.shape[1])
    for t in range(F.shape[0] - 1, -1, -1):
        first = np.maximum(first, ready[t])
        if t % 2 == 0:
            kt = k[t // 2]
            own = np.maximum(first + M * B[t] + (M - kt) * F[t], arrive[t] + M * (F[t] + B[t]))
            last = np.maximum(own, last + B[t])
            end = np.maximum(end, last + AR[t])
        else:
            last = last + B[t]
        first = first + B[t]
    return end
