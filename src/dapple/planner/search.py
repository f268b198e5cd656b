"""DAPPLE planning algorithm (section 5.3, equations 4-5): DP over partition, replication, placement.

``T_PL(j, m, g)``: the first j layers are planned as stages on the m devices ``g`` and the
remaining layers ``[j, N)`` form the last stage on the other G - m devices; its value is the
pipeline latency L of that whole plan (equation 2). One step (equation 5) cuts the last stage
at ``j' > j`` into a new stage ``[j, j')`` on ``m'`` devices placed by each of the three
policies (section 5.2) and a last stage ``[j', N)`` on the rest. Each state keeps its best
prefix (memoised search); the answer (equation 4) is the best state. The device set g is
represented by the per-server occupancy, which the placement policies fully determine. The
DP of one M is :class:`dapple.planner.cut_search.CutSearch`; :func:`dapple_search` resolves
its limits, ranks the M by their seeds (:func:`_rank_micro_batches`), runs the DP for the most
promising and refines the best plan.

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
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.memory import state_bytes_per_parameter_byte
from dapple.errors import InfeasibleError, ValidationError
from dapple.planner.cut_search import CutSearch, Incumbent, candidate_replicas, search_limits
from dapple.planner.evaluate import Scored, Scorer, StageSpec, divisors
from dapple.planner.partition import block_partition
from dapple.planner.widths import width_candidates

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
    tensor_widths: Sequence[int] | None = None,
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
            (:func:`~dapple.planner.cut_search.balanced_cut`); None tries every j'; -1
            (default) picks None for small instances, 1 beyond 128 devices and 2 otherwise.
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
            stage's choice (``StagePlan.zero_stage``); 3 (ZeRO-3) re-gathers per
            micro-batch where memory asks for it (``StagePlan.regather``).
        tensor_widths: the tensor widths t to search, one search each with every stage of
            width t (:mod:`dapple.planner.widths`); the best plan over them wins (the
            narrower on ties). None: :func:`~dapple.planner.widths.width_candidates` (1 alone
            for a profile with no layer that shards).

    Raises:
        InfeasibleError: no plan fits device memory for any M.
    """
    widths = width_candidates(profile, cluster) if tensor_widths is None else list(tensor_widths)
    Ms = micro_batch_candidates(global_batch_size)
    found: list[tuple[float, int, Plan]] = []
    for i, t in enumerate(widths):
        sc = Scorer(profile, cluster, global_batch_size, zero_stage, tensor_width=t)
        limits = search_limits(sc.N, sc.G, max_stages, states_per_layer, window, keep, m_candidates)
        best = Incumbent()
        ranked = _rank_micro_batches(sc, Ms, global_batch_size, limits.max_stages, best)
        if limits.m_candidates is not None:
            ranked = ranked[: limits.m_candidates]
        cuts = cut_points(sc, cut_limit)
        for done, M in enumerate(ranked, 1):
            CutSearch(sc, sc.cluster, cuts, M, global_batch_size // M, limits, best).run()
            if progress is not None:
                progress(i * len(ranked) + done, len(widths) * len(ranked))
        log.debug("dapple search, width %d: %d candidates scored", t, sc.evaluations)
        if best.scored is not None:
            stages, M, scored = _refine(sc, best.stages, best.M, best.scored, Ms)
            found.append((scored.L_ms, t, sc.build_plan("dapple", stages, M, scored)))
    if not found:
        raise InfeasibleError(_infeasible_message(profile, cluster, global_batch_size))
    return min(found, key=lambda x: (x[0], x[1]))[2]


def _rank_micro_batches(
    sc: Scorer, Ms: Sequence[int], global_batch_size: int, max_stages: int, best: Incumbent
) -> list[int]:
    """Score every M's regular candidates (:func:`_seeds`, at most ``max_stages`` stages),
    offering each that fits to ``best``; the M, most promising (lowest such L) first, so that
    the incumbent prunes the later ones harder."""
    ranked: list[tuple[float, int]] = []
    for M in Ms:
        m_best = math.inf
        for stages in _seeds(sc, global_batch_size // M):
            if len(stages) > max_stages:
                continue
            got = sc.score(stages, M)
            if got is not None:
                m_best = min(m_best, got.L_ms)
                if best.scored is None or got.L_ms < best.L_ms:
                    best.take(stages, M, got)
        ranked.append((m_best, M))
    ranked.sort()
    return [M for _, M in ranked]


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
