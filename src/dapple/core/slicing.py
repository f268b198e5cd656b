"""Split-concat arithmetic (paper section 6.2): how a micro-batch is cut into replica slices.

Pure, no torch. A micro-batch of ``b`` samples entering a stage of ``r`` replicas is split into
``r`` contiguous slices, uneven when ``r`` does not divide ``b`` (replica ``j`` takes slice j);
between two stages each overlap of a source slice and a destination slice is one transfer.
"""

from __future__ import annotations

from dapple.core._json import require

__all__ = ["slice_bounds", "split_sizes", "transfers"]


def split_sizes(b: int, r: int) -> tuple[int, ...]:
    """Sizes of the ``r`` slices of a micro-batch of ``b`` samples: the first ``b % r`` get one more.

    Slices may be empty when ``r > b``.
    """
    require(b >= 0 and r >= 1, f"split_sizes needs b >= 0 and r >= 1, got b={b}, r={r}")
    q, rem = divmod(b, r)
    return tuple(q + 1 if j < rem else q for j in range(r))


def slice_bounds(b: int, r: int) -> tuple[tuple[int, int], ...]:
    """Sample ranges ``[lo, hi)`` of the ``r`` slices of ``split_sizes(b, r)``."""
    out = []
    lo = 0
    for n in split_sizes(b, r):
        out.append((lo, lo + n))
        lo += n
    return tuple(out)


def transfers(b: int, r_src: int, r_dst: int) -> tuple[tuple[int, int, int, int], ...]:
    """Split-concat between a stage with ``r_src`` replicas and one with ``r_dst`` (section 6.2).

    Returns ``(j, k, lo, hi)`` for every non-empty overlap: replica ``j`` of the source sends
    samples ``[lo, hi)`` of the micro-batch to replica ``k`` of the destination. Covers
    one-to-one, one-to-many (split), many-to-one (concat) and many-to-many alike.
    """
    src = slice_bounds(b, r_src)
    dst = slice_bounds(b, r_dst)
    out = []
    for j, (a0, a1) in enumerate(src):
        for k, (c0, c1) in enumerate(dst):
            lo, hi = max(a0, c0), min(a1, c1)
            if lo < hi:
                out.append((j, k, lo, hi))
    return tuple(out)
