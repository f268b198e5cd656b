"""DAPPLE planning algorithm (section 5.3, equations 4-5): DP over partition, replication, placement.

``T_PL(j, m, g)``: the first j layers are planned as stages on the m devices ``g`` and the
remaining layers ``[j, N)`` form the last stage on the other G - m devices; its value is the
pipeline latency L of that whole plan (equation 2). One step (equation 5) cuts the last stage
at ``j' > j`` into a new stage ``[j, j')`` on ``m'`` devices placed by each of the three
policies (section 5.2) and a last stage ``[j', N)`` on the rest. Each state keeps its best
prefix (memoised search); the answer (equation 4) is the best state. The device set g is
represented by the per-server occupancy, which the placement policies fully determine.

Beyond the paper: the search also chooses M among divisors of the global batch size (at most
:data:`MAX_MICRO_BATCH_COUNTS` of them, :func:`micro_batch_candidates`, so the work does not
grow with the batch), the warm-up policy A/B, and per stage re-computation and the in-flight
bound D when memory demands them (:class:`dapple.planner.evaluate.Scorer`). It is kept fast by:

* a lower bound ``L >= M (F_s + B_s)`` of a computation stage s: a new stage reaching the best
  L found stops the scan over longer stages, and prefixes holding such a stage are dropped;
* regular seed candidates (:func:`_seeds`: k time-balanced stages on r consecutive devices,
  also with idle devices) scored first, giving a good incumbent and ranking the M;
* states keyed by occupancy up to a permutation of servers (servers are interchangeable);
* on instances with N x G > 128 only: a beam of ``states_per_layer`` states per cut point
  (4, or 2 beyond 128 devices), new cuts within ``window`` cut points of the two-stage
  balance point (2, or 1 beyond 128 devices), one prefix per state
  (the paper's memoisation; small instances keep 64), the DP for the 3 most promising M;
* beyond ``cut_limit`` layers, cuts only at that many equal-time positions
  (:func:`cut_points`); always a final one-layer hill climb of the best plan's cuts and a
  re-pick of M (:func:`_refine`);
* beyond 32 devices, replica counts by server counts (:func:`candidate_replicas`).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Sequence

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, split_sizes
from dapple.core.profile import ModelProfile
from dapple.cost.memory import state_bytes_per_parameter_byte
from dapple.errors import InfeasibleError, ValidationError
from dapple.planner.evaluate import Scored, Scorer, StageSpec, divisors
from dapple.planner.partition import block_partition
from dapple.planner.placement import POLICIES, place, remaining_devices

__all__ = [
    "DENSE_MICRO_BATCH_COUNTS",
    "DIVISOR_SCAN",
    "MAX_GLOBAL_BATCH_SIZE",
    "MAX_MICRO_BATCH_COUNTS",
    "candidate_replicas",
    "check_global_batch_size",
    "dapple_search",
    "micro_batch_candidates",
]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
_Entry = tuple[float, tuple[StageSpec, ...], tuple[int, ...]]


MAX_MICRO_BATCH_COUNTS = 64
"""Most candidate M a planner tries for one global batch size (every planner's work is
proportional to it, never to the global batch size itself)."""
DENSE_MICRO_BATCH_COUNTS = 32
"""Every divisor M up to this is a candidate: there one more micro-batch changes the bubble
share ``(S - 1) / (M + S - 1)`` of the step most."""
MAX_GLOBAL_BATCH_SIZE = 2**53
"""Largest global batch size planned: the cost model counts samples in floating point, exact
for integers up to 2^53."""
DIVISOR_SCAN = 1 << 16
"""Trial divisions spent finding the divisors of the global batch size G: every M with
``M <= DIVISOR_SCAN`` or ``G / M <= DIVISOR_SCAN`` (few micro-batches, or small ones) is found;
that is every divisor when ``G <= DIVISOR_SCAN**2``."""


def check_global_batch_size(global_batch_size: int) -> None:
    """Refuse a global batch size above :data:`MAX_GLOBAL_BATCH_SIZE`.

    Raises:
        ValidationError: naming the size and the limit.
    """
    if global_batch_size > MAX_GLOBAL_BATCH_SIZE:
        digits = str(global_batch_size)
        shown = digits if len(digits) <= 24 else f"{digits[:6]}... ({len(digits)} digits)"
        raise ValidationError(
            f"global batch size {shown} is above the largest the planner "
            f"handles, 2^53 = {MAX_GLOBAL_BATCH_SIZE:,} (samples are counted in floating point)"
        )


def micro_batch_candidates(
    global_batch_size: int, limit: int = MAX_MICRO_BATCH_COUNTS
) -> list[int]:
    """Candidate M: divisors of the global batch size G, at most ``limit`` of them.

    The divisors found by :data:`DIVISOR_SCAN` trial divisions (all of them for G up to 2^32);
    when they are more than ``limit``: every one up to :data:`DENSE_MICRO_BATCH_COUNTS` (in
    at most half the slots), and for the other slots the divisors nearest to targets evenly
    spaced in log M up to M = G (always kept), so a planner's work does not grow with G.

    Raises:
        InfeasibleError: the global batch size is not a positive integer.
        ValidationError: it is above :data:`MAX_GLOBAL_BATCH_SIZE`.
    """
    if global_batch_size < 1:
        raise InfeasibleError(f"global batch size must be >= 1, got {global_batch_size}")
    check_global_batch_size(global_batch_size)
    found = divisors(global_batch_size, DIVISOR_SCAN)
    if len(found) <= limit:
        return found
    picked = set(found[: min(limit // 2, bisect.bisect_right(found, DENSE_MICRO_BATCH_COUNTS))])
    rest = found[len(picked) :]
    logs = [math.log(m) for m in rest]
    slots = limit - len(picked)
    for k in range(1, slots + 1):  # targets up to log G, the last one M = G itself
        target = logs[0] + (logs[-1] - logs[0]) * k / slots
        i = bisect.bisect_left(logs, target)
        near = [j for j in (i - 1, i) if 0 <= j < len(rest)]
        picked.add(rest[min(near, key=lambda j: abs(logs[j] - target))])
    return sorted(picked)


def candidate_replicas(cluster: Cluster, available: int) -> list[int]:
    """Replica counts tried for a new stage with ``available`` free devices.

    All of 1..available on up to 32 devices. Beyond (placements by server counts rather than
    device ids): 1..devices_per_server, then whole servers up to 128 devices, and past that
    only powers of two and three times powers of two (1, 2, 3, 4, 6, 8, 12, 16, 24, ...).
    """
    if cluster.num_devices <= 32:
        return list(range(1, available + 1))
    dps = cluster.devices_per_server
    c = set(range(1, min(dps, available) + 1))
    if cluster.num_devices <= 128:
        c.update(k * dps for k in range(1, available // dps + 1))
    p = 1
    while p <= available:
        c.add(p)
        if 3 * p <= available:
            c.add(3 * p)
        p *= 2
    return sorted(c)


def _bound(sc: Scorer, s: int, e: int, r: int, b: int, M: int) -> float:
    """M (F_s + B_s) of a stage without re-computation: a lower bound on L."""
    f, bw = sc.fb_ms(s, e, split_sizes(b, r)[0])
    return M * (f + bw)


def _balanced_cut(sc: Scorer, cuts: Sequence[int], ji: int, r1: int, r2: int, b: int) -> int:
    """Smallest index i > ji into ``cuts`` (below the last) where stage [cuts[ji], cuts[i]) on
    r1 replicas is at least as slow per micro-batch as [cuts[i], N) on r2: the two-stage
    balance point."""
    j = cuts[ji]
    lo, hi = ji + 1, len(cuts) - 2
    s1, s2 = -(-b // r1), -(-b // r2)
    while lo < hi:
        mid = (lo + hi) // 2
        f1, b1 = sc.fb_ms(j, cuts[mid], s1)
        f2, b2 = sc.fb_ms(cuts[mid], sc.N, s2)
        if f1 + b1 >= f2 + b2:
            hi = mid
        else:
            lo = mid + 1
    return lo


def cut_points(sc: Scorer, limit: int) -> list[int]:
    """Layer boundaries the DP may cut at: all of 0..N when N <= limit, else ``limit`` points
    at equal steps of cumulative compute time (the final plan's cuts are then refined by
    :func:`_refine` to single layers)."""
    N = sc.N
    if limit >= N:
        return list(range(N + 1))
    total = sum(sc.fb_ms(0, N, 1))
    out = {0, N}
    layer = 0
    for k in range(1, limit):
        target = total * k / limit
        while layer < N and sum(sc.fb_ms(0, layer, 1)) < target:
            layer += 1
        out.add(layer)
    return sorted(out)


def _refine(
    sc: Scorer, stages: list[StageSpec], M: int, best: Scored, Ms: Sequence[int]
) -> tuple[list[StageSpec], int, Scored]:
    """Hill-climb the cut positions one layer at a time, then re-pick M for the structure."""
    improved = True
    rounds = 0
    while improved and rounds < 4 * sc.N:
        improved = False
        rounds += 1
        for i in range(len(stages) - 1):
            for delta in (-1, 1):
                cut = stages[i][1] + delta
                if not stages[i][0] < cut < stages[i + 1][1]:
                    continue
                cand = list(stages)
                cand[i] = (stages[i][0], cut, stages[i][2])
                cand[i + 1] = (cut, stages[i + 1][1], stages[i + 1][2])
                got = sc.score(cand, M)
                if got is not None and got.L_ms < best.L_ms:
                    stages, best, improved = cand, got, True
    for m in Ms:
        got = sc.score(stages, m)
        if got is not None and got.L_ms < best.L_ms:
            M, best = m, got
    return stages, M, best


def _seeds(sc: Scorer, b: int) -> list[list[StageSpec]]:
    """Regular candidates scored first, giving the pruning a good incumbent and covering plans
    that leave devices idle (which the DP, using all G devices like the paper, cannot): k
    stages balanced by time (:func:`block_partition`), each on r consecutive devices, k r <= G.
    """
    N, G = sc.N, sc.G
    big = G > 32
    ks = list(range(1, min(N, G) + 1))
    if big:
        ks = sorted({k for k in ks if k & (k - 1) == 0} | {min(N, G)})
    times = []
    for i in range(N):
        f, bw = sc.fb_ms(i, i + 1, b)
        times.append(f + bw)
    out: list[list[StageSpec]] = []
    for k in ks:
        cuts = block_partition(times, k, exact=N <= 16)
        rs = {G // k} | (
            {r for r in range(1, G // k + 1) if r & (r - 1) == 0}
            if big
            else set(range(1, G // k + 1))
        )
        for r in sorted(rs):
            out.append([(cuts[i], cuts[i + 1], tuple(range(i * r, (i + 1) * r))) for i in range(k)])
    return out


def dapple_search(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    *,
    max_stages: int | None = None,
    states_per_layer: int | None = -1,
    window: int | None = -1,
    keep: int = -1,
    m_candidates: int | None = -1,
    cut_limit: int = 64,
    progress: Progress | None = None,
    zero_stage: int = 0,
) -> Plan:
    """The DAPPLE plan minimising L (equations 4-5) over partition, replication, placement, M.

    Args:
        profile: model profile (N layers).
        cluster: G devices.
        global_batch_size: samples per step.
        max_stages: cap on computation stages (default: no cap but G).
        states_per_layer: keep only this many best states per layer boundary j (a beam);
            None keeps every state; -1 (default) picks None for small instances (N x G <= 128),
            2 beyond 128 devices and 4 otherwise.
        window: try cut points j' within this distance of the two-stage balance point
            (:func:`_balanced_cut`); None tries every j'; -1 (default) picks None for small
            instances, 1 beyond 128 devices and 2 otherwise.
        keep: prefixes kept per state (memoised search keeps 1 in the paper); -1 (default)
            picks 64 for small instances and 1 otherwise.
        m_candidates: run the DP for only this many micro-batch counts M, the most promising
            by their best regular candidate (:func:`_seeds`); None runs every
            :func:`micro_batch_candidates`; -1 (default) picks None for small instances, else 3.
            The final plan's M is re-picked among all the candidates.
        cut_limit: the DP cuts only at :func:`cut_points` (at most this many + 1); the
            final cuts are refined layer by layer.
        progress: called as ``progress(done, total)`` after each candidate M.
        zero_stage: 1: replicated stages shard their optimizer state (ZeRO-1), 2: their
            gradients too (ZeRO-2), in memory and in AR_s;
            :data:`~dapple.planner.evaluate.ZERO_AUTO` (-1): per stage, where memory asks for it (:class:`~dapple.planner.evaluate.Scorer`). The plan records each
            stage's choice (``StagePlan.zero_stage``).

    Raises:
        InfeasibleError: no plan fits device memory for any M.
    """
    sc = Scorer(profile, cluster, global_batch_size, zero_stage)
    N, G = sc.N, sc.G
    S_max = min(G, N, max_stages or G)
    small = N * G <= 128
    huge = G > 128
    if states_per_layer == -1:
        states_per_layer = None if small else (2 if huge else 4)
    if window == -1:
        window = None if small else (1 if huge else 2)
    if keep == -1:
        keep = 64 if small else 1
    if m_candidates == -1:
        m_candidates = None if small else 3
    cuts = cut_points(sc, cut_limit)
    C = len(cuts)
    best: tuple[float, list[StageSpec], int, Scored] | None = None
    Ms = micro_batch_candidates(global_batch_size)
    ranked: list[tuple[float, int]] = []
    for M in Ms:
        m_best = math.inf
        for stages in _seeds(sc, global_batch_size // M):
            if len(stages) > S_max:
                continue
            got = sc.score(stages, M)
            if got is not None:
                m_best = min(m_best, got.L_ms)
                if best is None or got.L_ms < best[0]:
                    best = (got.L_ms, stages, M, got)
        ranked.append((m_best, M))
    ranked.sort()  # most promising M first: the incumbent then prunes the others harder
    if m_candidates is not None:
        ranked = ranked[:m_candidates]
    all_devices = tuple(range(G))
    for done, (_, M) in enumerate(ranked, 1):
        b = global_batch_size // M
        incumbent = best[0] if best else math.inf
        # memo[(cut index, sorted occupancy)] = up to `keep` entries (L, prefix stages,
        # occupancy), best first; an entry's plan is prefix + [j, N) on the other devices
        # (L = inf when that completion does not fit: the prefix may still fit once [j, N)
        # is split). Servers are interchangeable, so occupancies equal up to a permutation
        # of servers share one state.
        memo: dict[tuple[int, tuple[int, ...]], list[_Entry]] = {}
        buckets: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in range(C)]
        zero = (0,) * cluster.servers
        first = sc.score([(0, N, all_devices)], M)
        memo[(0, zero)] = [(first.L_ms if first else math.inf, (), zero)]
        buckets[0].append((0, zero))
        for ji in range(C - 2):
            j = cuts[ji]
            keys = buckets[ji]
            if states_per_layer is not None and len(keys) > states_per_layer:
                keys = sorted(keys, key=lambda k: memo[k][0][0])[:states_per_layer]
            for key in keys:
                for _, prefix, occ in memo[key]:
                    if len(prefix) + 2 > S_max:
                        continue
                    if any(_bound(sc, s, e, len(d), b, M) >= incumbent for s, e, d in prefix):
                        continue
                    used = sum(occ)
                    for m1 in candidate_replicas(cluster, G - used - 1):
                        seen: set[tuple[int, ...]] = set()
                        lo, hi = ji + 1, C - 2
                        if window is not None:
                            mid = _balanced_cut(sc, cuts, ji, m1, G - used - m1, b)
                            lo, hi = max(lo, mid - window), min(hi, mid + window)
                        for pol in POLICIES:
                            placed = place(cluster, occ, m1, pol)
                            if placed is None or placed[0] in seen:
                                continue
                            g1, occ1 = placed
                            seen.add(g1)
                            rest = remaining_devices(cluster, occ1)
                            canon = tuple(sorted(occ1))
                            for j1i in range(lo, hi + 1):
                                j1 = cuts[j1i]
                                if _bound(sc, j, j1, m1, b, M) >= incumbent:
                                    break
                                stages = [*prefix, (j, j1, g1), (j1, N, rest)]
                                got = sc.score(stages, M)
                                lat = got.L_ms if got is not None else math.inf
                                k1 = (j1i, canon)
                                entries = memo.get(k1)
                                if entries is None:
                                    entries = memo[k1] = []
                                    buckets[j1i].append(k1)
                                if len(entries) < keep or lat < entries[-1][0]:
                                    entries.append((lat, (*prefix, (j, j1, g1)), occ1))
                                    entries.sort(key=lambda x: x[0])
                                    del entries[keep:]
                                if got is not None and lat < incumbent:
                                    incumbent = lat
                                    best = (lat, stages, M, got)
        if progress is not None:
            progress(done, len(ranked))
    log.debug("dapple search: %d candidates scored", sc.evaluations)
    if best is None:
        raise InfeasibleError(_infeasible_message(profile, cluster, global_batch_size))
    _, stages, M, scored = best
    stages, M, scored = _refine(sc, stages, M, scored, Ms)
    return sc.build_plan("dapple", stages, M, scored)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _infeasible_message(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> str:
    f = state_bytes_per_parameter_byte(profile)
    state = profile.parameter_bytes * f
    r = cluster.reserved_memory_bytes
    reserved = f" ({_bytes(r)} of each reserved for the runtime)" if r else ""
    need = max(
        layer.parameter_bytes * f + layer.kept_activation_bytes_per_sample
        for layer in profile.for_memory.layers
    )
    return (
        f"no plan of {profile.model_name!r} ({profile.num_layers} layers, "
        f"{_bytes(state)} of parameters+gradients+optimizer state; one layer alone needs up to "
        f"{_bytes(need)} with one sample) fits {cluster.num_devices} devices of "
        f"{_bytes(cluster.device_memory_bytes)}{reserved} with global batch size "
        f"{global_batch_size}"
    )
