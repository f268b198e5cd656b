"""Split-concat arithmetic (paper section 6.2): how a micro-batch is cut into replica slices.

Pure, no torch. A micro-batch of ``b`` samples entering a stage of ``r`` replicas is split into
``r`` contiguous slices, replica ``j`` taking slice j: evenly by default (uneven by one sample
when ``r`` does not divide ``b``), or by the stage's per-replica ``shares`` (whole samples,
each >= 1, summing to ``b``; a faster replica takes more). Between two stages each overlap of a
source slice and a destination slice is one transfer.
"""

from __future__ import annotations

from collections.abc import Sequence

from dapple.core._json import require

__all__ = ["check_shares", "proportional_shares", "slice_bounds", "split_sizes", "transfers"]

Shares = Sequence[int] | None
"""Per-replica samples of a micro-batch, or None for the even split."""


def check_shares(shares: Sequence[int], b: int, r: int, what: str = "shares") -> None:
    """Check ``shares`` as ``r`` whole samples >= 1 summing to ``b``.

    Raises:
        ValidationError: wrong count, a share that is not an integer >= 1, or a wrong sum.
    """
    got = list(shares)
    require(len(got) == r, f"{what} {got} must give one share per replica: {len(got)} != {r}")
    require(
        all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in got),
        f"{what} {got} must be whole samples >= 1 each",
    )
    require(sum(got) == b, f"{what} {got} sum to {sum(got)}, not the micro-batch size {b}")


def split_sizes(b: int, r: int, shares: Shares = None) -> tuple[int, ...]:
    """Sizes of the ``r`` slices of a micro-batch of ``b`` samples: ``shares`` when given (checked
    by :func:`check_shares`), else even, the first ``b % r`` getting one more.

    Even slices may be empty when ``r > b``.
    """
    require(b >= 0 and r >= 1, f"split_sizes needs b >= 0 and r >= 1, got b={b}, r={r}")
    if shares is not None:
        check_shares(shares, b, r)
        return tuple(shares)
    q, rem = divmod(b, r)
    return tuple(q + 1 if j < rem else q for j in range(r))


def slice_bounds(b: int, r: int, shares: Shares = None) -> tuple[tuple[int, int], ...]:
    """Sample ranges ``[lo, hi)`` of the ``r`` slices of ``split_sizes(b, r, shares)``."""
    out = []
    lo = 0
    for n in split_sizes(b, r, shares):
        out.append((lo, lo + n))
        lo += n
    return tuple(out)


def transfers(
    b: int, r_src: int, r_dst: int, src_shares: Shares = None, dst_shares: Shares = None
) -> tuple[tuple[int, int, int, int], ...]:
    """Split-concat between a stage with ``r_src`` replicas and one with ``r_dst`` (section 6.2),
    each cut by its shares (None: evenly).

    Returns ``(j, k, lo, hi)`` for every non-empty overlap: replica ``j`` of the source sends
    samples ``[lo, hi)`` of the micro-batch to replica ``k`` of the destination. Covers
    one-to-one, one-to-many (split), many-to-one (concat) and many-to-many alike.
    """
    src = slice_bounds(b, r_src, src_shares)
    dst = slice_bounds(b, r_dst, dst_shares)
    out = []
    for j, (a0, a1) in enumerate(src):
        for k, (c0, c1) in enumerate(dst):
            lo, hi = max(a0, c0), min(a1, c1)
            if lo < hi:
                out.append((j, k, lo, hi))
    return tuple(out)


def proportional_shares(weights: Sequence[float], b: int) -> tuple[int, ...]:
    """Whole-sample shares of ``b`` proportional to ``weights`` (e.g. replica speeds), each >= 1:
    ``b w_j / sum(w)`` rounded down, the samples left by largest remainder (ties to the lower
    index), then each empty share takes one sample from the largest.

    Raises:
        ValidationError: no weights, a weight that is not finite and > 0, or ``b`` below the
            replica count.
    """
    w = [float(x) for x in weights]
    r = len(w)
    require(
        r >= 1 and all(0 < x < float("inf") for x in w),
        f"proportional_shares needs finite weights > 0, got {list(weights)}",
    )
    require(b >= r, f"proportional_shares: {b} samples cannot give each of {r} replicas one")
    quota = [b * x / sum(w) for x in w]
    out = [int(q) for q in quota]
    by_remainder = sorted(range(r), key=lambda j: (-(quota[j] - out[j]), j))
    for j in by_remainder[: b - sum(out)]:
        out[j] += 1
    for j in range(r):
        if out[j] == 0:
            out[out.index(max(out))] -= 1
            out[j] = 1
    return tuple(out)
