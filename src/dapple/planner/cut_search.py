"""Equation 5's DP for one micro-batch count M: from cut point to cut point (section 5.3).

A state is ``(j, g)``: the first j layers planned as stages on the devices g (by per-server
occupancy, which the placement policies fully determine; servers are interchangeable, so
occupancies equal up to a permutation of servers share one state). One step cuts the last stage
``[j, N)`` at ``j' > j`` into a new stage ``[j, j')`` on m' devices, placed by each policy of
section 5.2, and a last stage ``[j', N)`` on the rest. :class:`CutSearch` runs the steps of one
M; the :class:`Incumbent` (the best plan so far, over every M) prunes them through the lower
bound ``L >= M (F_s + B_s)`` of a stage (:func:`stage_bound`).
:func:`dapple.planner.search.dapple_search` runs it for the most promising M.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dapple.core.cluster import Cluster
from dapple.planner.placement import POLICIES, first_free_devices, first_placed, place
from dapple.planner.scorer import Scored, Scorer, StageSpec

__all__ = [
    "CutSearch",
    "Incumbent",
    "SearchLimits",
    "balanced_cut",
    "candidate_replicas",
    "kept_placements",
    "search_limits",
    "stage_bound",
    "stage_unfit",
]

_Entry = tuple[float, tuple[StageSpec, ...], tuple[int, ...]]
"""A state's kept prefix: ``(L of prefix + [j, N) on the rest, prefix stages, occupancy)``."""

_Placed = tuple[tuple[int, ...], tuple[int, ...]]
"""A new stage's devices and the occupancy after it."""


_Top = tuple[float, StageSpec, tuple[int, ...]] | None
"""A prefix's best cut scanned: ``(L, new stage, the last stage's devices)``, or None."""


def _lower(a: _Top, b: _Top) -> _Top:
    """The one of lower L (``a`` on ties; None only when both are)."""
    return b if a is None or (b is not None and b[0] < a[0]) else a


_EVERY_COUNT = 32
"""Every replica count up to this is tried (:func:`candidate_replicas`)."""


def candidate_replicas(cluster: Cluster, available: int, devices: int | None = None) -> list[int]:
    """Replica counts tried for a new stage with ``available`` free devices.

    All of 1..available on up to 32 devices. Beyond (placements by server counts rather than
    device ids): 1..devices_per_server (1..32 in a larger server), then whole servers up to 128
    devices, and past that only powers of two and three times powers of two (1, 2, 3, 4, 6, 8,
    12, 16, 24, ...).
    ``devices``: the count deciding these classes (None: the cluster's; a search on tensor
    groups passes the devices they group, :attr:`SearchLimits.devices`).
    """
    n = cluster.num_devices if devices is None else devices
    if n <= _EVERY_COUNT:
        return list(range(1, available + 1))
    dps = cluster.devices_per_server
    c = set(range(1, min(dps, available, _EVERY_COUNT) + 1))
    if n <= 128:
        c.update(k * dps for k in range(1, available // dps + 1))
    p = 1
    while p <= available:
        c.add(p)
        if 3 * p <= available:
            c.add(3 * p)
        p *= 2
    return sorted(c)


def last_stage_counts(b: int, n: int) -> list[int]:
    """The replica counts the last stage is scored on, given ``n`` free devices (n <= b): n,
    and before it each smaller count that is the fewest giving its largest slice
    ``ceil(b / r)`` (a count between two of them has the same slice as the smaller one and
    more to AllReduce). Ascending, n last."""
    smallest = {-(-b // -(-b // r)) for r in range(1, n)}
    return [*sorted(smallest - {n}), n]


def kept_placements(
    cluster: Cluster, occ: tuple[int, ...], whole: _Placed, b: int, idle: bool = True
) -> tuple[_Placed, ...]:
    """The placements a new stage is scored on, given ``whole``, a policy's placement of its
    m' devices from ``occ``: ``whole`` itself when m' <= b; else its first b devices (by id:
    the replicas a micro-batch's b samples reach), once with the other m' - b freed
    (:func:`~dapple.planner.placement.first_placed`) and once with them left idle (``whole``'s
    occupancy: the later stages start where the whole placement ends, as in the oracle's
    space, where a stage of m' > b replicas keeps all m'; not with ``idle`` False)."""
    if len(whole[0]) <= b:
        return (whole,)
    kept = first_placed(cluster, occ, whole[0], b)
    return (kept, (kept[0], whole[1])) if idle else (kept,)


def stage_bound(sc: Scorer, s: int, e: int, r: int, b: int, M: int) -> float:
    """M (F_s + B_s) of a stage without re-computation: a lower bound on L."""
    f, bw = sc.fb_ms(s, e, -(-b // r))  # split_sizes(b, r)[0], the largest slice
    return M * (f + bw)


def stage_unfit(sc: Scorer, s: int, e: int, d: tuple[int, ...], b: int) -> bool:
    """Whether layers [s, e) on ``d`` hold no micro-batch under any of the scorer's options,
    with or without re-computation, whatever the rest of the plan; False for a stage with no
    option (no shardable layer at t > 1: a longer one may have options)."""
    options = sc.stage_options(s, e, d, b)
    usable = sc.cluster.usable_memory_bytes
    return bool(options) and all(r.floor > usable for _, r in options)


def balanced_cut(sc: Scorer, cuts: Sequence[int], ji: int, r1: int, r2: int, b: int) -> int:
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


@dataclass(frozen=True, slots=True)
class SearchLimits:
    """How far :func:`~dapple.planner.search.dapple_search` looks on one instance (its ``-1``
    defaults resolved)."""

    max_stages: int
    """S_max: the most computation stages of a plan."""
    states_per_layer: int | None
    """Beam: states kept per cut point; None keeps every state."""
    window: int | None
    """New cuts within this many cut points of the two-stage balance point; None: every cut."""
    keep: int
    """Prefixes kept per state (1: the paper's memoisation)."""
    m_candidates: int | None
    """The DP runs for this many most promising M; None: every candidate."""
    devices: int | None = None
    """The devices a search on tensor groups (:func:`~dapple.planner.widths.group_cluster`)
    groups: they, not the groups, set the instance's size class here and in
    :func:`candidate_replicas`; None: the searched cluster's."""
    drop_unfit: bool = False
    """Stop scanning a new stage's cut points at the first where the stage alone fits no
    memory (:func:`stage_unfit`; longer stages on its devices fit no better): its prefixes
    never complete to a plan. False keeps them as states (the width-1 search does)."""
    idle_beyond_b: bool = True
    """A placement of m' > b devices is scored also with its devices beyond the first b left
    idle, not only freed (:func:`kept_placements`)."""


def search_limits(
    N: int,
    G: int,
    max_stages: int | None,
    states_per_layer: int | None,
    window: int | None,
    keep: int,
    m_candidates: int | None,
    devices: int | None = None,
) -> SearchLimits:
    """:func:`~dapple.planner.search.dapple_search`'s knobs for N layers on G devices, each
    ``-1`` replaced by its default: no beam, no window, 64 prefixes and every M on small
    instances (N x G <= 128); otherwise a beam of 4 (2 beyond 128 devices), a window of 2 (1),
    one prefix and the 3 best M; the devices beyond b of a placement left idle as well as freed
    up to 128 devices (:attr:`SearchLimits.idle_beyond_b`; beyond, its added states cost time
    and found no better plan in ``benchmarks/planning_time.md``'s cases).
    ``devices``: G's tensor groups group this many devices, which decide the size class
    (:attr:`SearchLimits.devices`)."""
    size = G if devices is None else devices
    small = N * size <= 128
    huge = size > 128
    if states_per_layer == -1:
        states_per_layer = None if small else (2 if huge else 4)
    if window == -1:
        window = None if small else (1 if huge else 2)
    if keep == -1:
        keep = 64 if small else 1
    if m_candidates == -1:
        m_candidates = None if small else 3
    return SearchLimits(
        min(G, N, max_stages or G),
        states_per_layer,
        window,
        keep,
        m_candidates,
        devices,
        idle_beyond_b=not huge,
    )


@dataclass(slots=True)
class Incumbent:
    """The best plan found so far, over every M: its L prunes the search."""

    L_ms: float = math.inf
    """Its pipeline latency L (inf until a plan fits); a bound alone while ``scored`` is None
    (a caller's ``below_ms``)."""
    stages: list[StageSpec] = field(default_factory=list)
    M: int = 0
    scored: Scored | None = None

    finest: dict[int, tuple[list[StageSpec], Scored]] = field(default_factory=dict)
    """At each M, the plan of most stages offered (:meth:`offer`; of least L among those),
    whatever its L: another start for the local searches that follow the DP, which merge stages
    and never split one."""

    def take(self, stages: list[StageSpec], M: int, scored: Scored) -> None:
        self.L_ms, self.stages, self.M, self.scored = scored.L_ms, stages, M, scored

    def offer(self, stages: list[StageSpec], M: int, scored: Scored) -> None:
        """Keep ``stages`` at M as its M's :attr:`finest` when it has more stages (or as many
        and a lower L), and take it when its L is below the incumbent's."""
        kept = self.finest.get(M)
        if kept is None or (len(stages), -scored.L_ms) > (len(kept[0]), -kept[1].L_ms):
            self.finest[M] = (stages, scored)
        if scored.L_ms < self.L_ms:
            self.take(stages, M, scored)


_Key = tuple[int, tuple[int, ...]]
"""A DP state: (index into the cut points, occupancy sorted: servers are interchangeable)."""


class CutSearch:
    """Equation 5's DP for one M, from cut point to cut point.

    ``memo[(cut index, sorted occupancy)]`` holds up to ``keep`` entries ``(L, prefix stages,
    occupancy)``, best first; an entry's plan is its prefix plus ``[j, N)`` on the other
    devices (L = inf when that completion does not fit: the prefix may still fit once
    ``[j, N)`` is split). Every plan scored is offered to ``best``. The last stage takes at most
    b of the free devices: a replica beyond the micro-batch's b samples would get none and
    only join the AllReduce.
    """

    def __init__(
        self,
        sc: Scorer,
        cluster: Cluster,
        cuts: Sequence[int],
        M: int,
        b: int,
        limits: SearchLimits,
        best: Incumbent,
    ) -> None:
        self.sc, self.cluster, self.cuts, self.M, self.b = sc, cluster, cuts, M, b
        self.limits, self.best = limits, best
        self.memo: dict[_Key, list[_Entry]] = {}
        self.buckets: list[list[_Key]] = [[] for _ in cuts]
        """The states at each cut point, in the order they were found."""
        empty = (0,) * cluster.servers
        first = sc.score([(0, sc.N, tuple(range(min(sc.G, b))))], M)
        self.memo[(0, empty)] = [(first.L_ms if first else math.inf, (), empty)]
        self.buckets[0].append((0, empty))

    def run(self) -> None:
        """Extend every kept prefix of every state, cut point by cut point."""
        for ji in range(len(self.cuts) - 2):
            for key in self.frontier(ji):
                for _, prefix, occ in self.memo[key]:
                    if not self.prunable(prefix):
                        self.extend(ji, prefix, occ)

    def frontier(self, ji: int) -> list[_Key]:
        """The states at cut point ``ji`` to extend: all, or the beam's best by L."""
        keys = self.buckets[ji]
        beam = self.limits.states_per_layer
        if beam is not None and len(keys) > beam:
            keys = sorted(keys, key=lambda k: self.memo[k][0][0])[:beam]
        return keys

    def prunable(self, prefix: tuple[StageSpec, ...]) -> bool:
        """The prefix cannot take two more stages, or one of its stages alone reaches the
        incumbent's L (:func:`stage_bound`)."""
        if len(prefix) + 2 > self.limits.max_stages:
            return True
        sc, b, M, incumbent = self.sc, self.b, self.M, self.best.L_ms
        return any(stage_bound(sc, s, e, len(d), b, M) >= incumbent for s, e, d in prefix)

    def extend(self, ji: int, prefix: tuple[StageSpec, ...], occ: tuple[int, ...]) -> None:
        """Cut a new stage off the last one at cut point ``ji``: on each replica count m',
        placed by each policy (section 5.2; placements giving the same devices and occupancy
        once). A placement of m' > b devices keeps its first b (by id): the replicas the
        micro-batch's b samples reach, in the servers that policy chose, the others freed or
        (:attr:`SearchLimits.idle_beyond_b`) left idle (:func:`kept_placements`); the counts
        above b stop after two in a row whose placements keep no new device set with the others
        freed. Then the best plan scored has its last stage tried on fewer devices
        (:meth:`fewer_last`)."""
        G, used, b = self.sc.G, sum(occ), self.b
        seen: set[tuple[int, ...]] = set()  # the devices of each placement scored, rest freed
        idled: set[tuple[int, ...]] = set()  # each whole placement scored with its rest idle
        top: _Top = None
        idle = 0
        for m1 in candidate_replicas(self.cluster, G - used - 1, self.limits.devices):
            lo, hi = self.cut_range(ji, min(m1, b), G - used - min(m1, b))
            fresh = False
            for pol in POLICIES:
                whole = place(self.cluster, occ, m1, pol)
                if whole is None:
                    continue
                kept, *rest = kept_placements(
                    self.cluster, occ, whole, b, self.limits.idle_beyond_b
                )
                if kept[0] not in seen:
                    seen.add(kept[0])
                    fresh = True
                    top = _lower(top, self.scan_cuts(ji, lo, hi, prefix, min(m1, b), kept))
                if rest and whole[0] not in idled:  # the whole placement fixes the occupancy
                    idled.add(whole[0])
                    top = _lower(top, self.scan_cuts(ji, lo, hi, prefix, b, rest[0]))
            idle = idle + 1 if m1 > b and not fresh else 0
            if idle == 2:  # two counts in a row kept no new device set: stop there
                break
        if top is not None:  # the best cut of this prefix, its last stage on fewer devices
            self.fewer_last(prefix, top[1], top[2])

    def cut_range(self, ji: int, m1: int, m2: int) -> tuple[int, int]:
        """The indices of the cut points ``j'`` the new stage may end at: every one after
        ``ji`` (below the last), or those within ``window`` of the two-stage balance point of
        m1 and m2 replicas (:func:`balanced_cut`)."""
        lo, hi = ji + 1, len(self.cuts) - 2
        window = self.limits.window
        if window is not None:
            mid = balanced_cut(self.sc, self.cuts, ji, m1, m2, self.b)
            lo, hi = max(lo, mid - window), min(hi, mid + window)
        return lo, hi

    def scan_cuts(
        self,
        ji: int,
        lo: int,
        hi: int,
        prefix: tuple[StageSpec, ...],
        m1: int,
        placed: tuple[tuple[int, ...], tuple[int, ...]],
    ) -> _Top:
        """Score the plans ``prefix + [j, j')`` on the m1 devices ``g1`` ``+ [j', N)`` on the
        rest for the cut points ``lo..hi``, shortest new stage first, until its bound reaches
        the incumbent, or until it fits no memory with ``drop_unfit`` (``placed``: ``g1`` and
        the occupancy with it). Returns the best of them, ``(L, [j, j'), the rest's devices)``
        (None: none scored)."""
        sc, cuts, M, b, best = self.sc, self.cuts, self.M, self.b, self.best
        g1, occ1 = placed
        j, N = cuts[ji], sc.N
        rest = first_free_devices(self.cluster, occ1, b)  # a replica beyond b would idle
        canon = tuple(sorted(occ1))
        top = (math.inf, -1)  # the cut whose completion on ``rest`` scored best
        for j1i in range(lo, hi + 1):
            j1 = cuts[j1i]
            if stage_bound(sc, j, j1, m1, b, M) >= best.L_ms:
                break
            if self.limits.drop_unfit and stage_unfit(sc, j, j1, g1, b):
                break
            stages = [*prefix, (j, j1, g1), (j1, N, rest)]
            got = sc.score(stages, M)
            lat = got.L_ms if got is not None else math.inf
            self.remember((j1i, canon), lat, (*prefix, (j, j1, g1)), occ1)
            top = min(top, (lat, j1))
            if got is not None:
                best.offer(stages, M, got)
        return None if top[1] < 0 else (top[0], (j, top[1], g1), rest)

    def fewer_last(
        self, prefix: tuple[StageSpec, ...], stage: StageSpec, rest: tuple[int, ...]
    ) -> None:
        """Score ``prefix + stage`` completed on fewer of the ``rest`` devices: each count of
        :func:`last_stage_counts` below ``len(rest)``, largest first, until the last stage's
        own bound reaches the incumbent (larger slices, less to AllReduce: it wins when the
        last stage's AllReduce outweighs its compute)."""
        sc, b, M, best, N = self.sc, self.b, self.M, self.best, self.sc.N
        j1 = stage[1]
        for r in reversed(last_stage_counts(b, len(rest))[:-1]):
            if stage_bound(sc, j1, N, r, b, M) >= best.L_ms:
                break  # and so for every smaller count
            stages = [*prefix, stage, (j1, N, rest[:r])]
            got = sc.score(stages, M)
            if got is not None:
                best.offer(stages, M, got)

    def remember(
        self, key: _Key, lat: float, prefix: tuple[StageSpec, ...], occ: tuple[int, ...]
    ) -> None:
        """Keep ``prefix`` in state ``key`` when it is among the state's ``keep`` best."""
        entries = self.memo.get(key)
        if entries is None:
            entries = self.memo[key] = []
            self.buckets[key[0]].append(key)
        keep = self.limits.keep
        if len(entries) < keep or lat < entries[-1][0]:
            entries.append((lat, prefix, occ))
            entries.sort(key=lambda x: x[0])
            del entries[keep:]
