"""Contiguous block partition minimising the largest block (torchgpipe's balance objective)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["block_partition"]


def _greedy(pre: Sequence[float], parts: int, limit: float) -> list[int] | None:
    """Cuts packing items greedily into blocks of sum <= limit, or None if > parts blocks."""
    n = len(pre) - 1
    cuts = [0]
    start = 0
    for i in range(1, n + 1):
        if pre[i] - pre[start] > limit:
            if i - 1 == start:
                return None  # one item alone exceeds the limit
            cuts.append(i - 1)
            start = i - 1
            if len(cuts) > parts:
                return None
    cuts.append(n)
    # split the largest blocks further until there are exactly `parts` non-empty blocks
    while len(cuts) - 1 < parts:
        widths = [(cuts[k + 1] - cuts[k], k) for k in range(len(cuts) - 1)]
        w, k = max(widths)
        if w < 2:
            return None
        cuts.insert(k + 1, cuts[k] + w // 2)
    return cuts


def block_partition(costs: Sequence[float], parts: int, *, exact: bool = True) -> list[int]:
    """Split ``costs`` into ``parts`` non-empty contiguous blocks minimising the largest sum.

    Exact dynamic programming for small inputs (``parts x N^2 <= 200000``) when ``exact``,
    otherwise a bisection on the largest sum with greedy packing (the largest block is within
    1e-9 relative of the bisection's bound; the packing may differ from the exact optimum).

    Args:
        costs: per-layer times (>= 0).
        parts: number of blocks, ``1 <= parts <= len(costs)``.
        exact: allow the exact O(parts N^2) dynamic program on small inputs.

    Returns:
        Cut positions ``[0, c_1, ..., N]``.

    Raises:
        ValueError: ``parts`` out of range.
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"block_partition needs 1 <= parts <= {n}, got {parts}")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    if exact and parts * n * n <= 200_000:
        inf = math.inf
        best = [[inf] * (n + 1) for _ in range(parts + 1)]
        arg = [[0] * (n + 1) for _ in range(parts + 1)]
        best[0][0] = 0.0
        for k in range(1, parts + 1):
            for i in range(k, n - (parts - k) + 1):
                for p in range(k - 1, i):
                    v = max(best[k - 1][p], pre[i] - pre[p])
                    if v < best[k][i]:
                        best[k][i] = v
                        arg[k][i] = p
        cuts = [n]
        i = n
        for k in range(parts, 0, -1):
            i = arg[k][i]
            cuts.append(i)
        return cuts[::-1]
    lo = max(costs) if costs else 0.0
    hi = pre[-1]
    found = _greedy(pre, parts, hi)
    for _ in range(100):
        if hi - lo <= 1e-9 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        got = _greedy(pre, parts, mid)
        if got is None:
            lo = mid
        else:
            hi, found = mid, got
    assert found is not None
    return found
