"""Interleaved 1F1B plans for the DAPPLE search, costed best first from lower bounds.

The DAPPLE DP costs the paper's L (equations 1-3); interleaved 1F1B (Narayanan et al., SC 2021)
is costed by replaying its compute order (:func:`~dapple.schedule.replay.replayed_step_ms`;
P device groups, v chunks each, T_g the F + B of group g's chunks), and so is its memory
(:func:`~dapple.cost.schedule_step.device_memory_by_group`). Both are a pass over the whole plan,
so :func:`best_interleaved` ranks the candidates by lower bounds, cheapest first:

* of L, ``max_g (M T_g + sum_{h<g} (F + B of stage h))`` with T_g summed layer by layer from
  the search's scorers (F + B of the largest replica slice at the group's width,
  :meth:`Scorer.fb_ms`; no re-computation, ZeRO-3 gathers or transfers): :func:`lower_bound_ms`;
* of the peak memory, each group's parameter state and the activations of the forwards it runs
  before its first backward: :func:`memory_floor_bytes`.

A candidate is costed (:func:`~dapple.cost.schedule_step.schedule_latency`) only while its bound is
below the best L found so far, and its memory replayed only while its floor fits and its L is
below; so the first that fits, in bound order, has the least L of all candidates that fit.

The candidates (:class:`Offer`), each at every M of the search that is a multiple of P with at
most :data:`~dapple.planner.grid.MAX_INTERLEAVED_ACTIONS` compute actions (M x P x v), so the
work does not grow with the global batch:

* grid (:func:`grid_offers`): the interleaved points of :func:`~dapple.planner.grid.grid_points`
  that a filter accepts (torchtitan's cuts, FSDP gathering once per step, else re-gathering on
  every stage, as :mod:`dapple.planner.grid` scores them);
* own (:func:`own_offers`): each plan of the search, its device groups, widths, zero stages and
  re-computation kept, cut into v chunks per group (:func:`~dapple.core.plan.interleave`), as
  planned where v divides each group's layers, else after moving every cut to the nearest
  multiple of v; ZeRO-3 stages gathering once per step, as planned, or re-gathering
  (:func:`regather_variants`).

Each candidate is also tried with its chunk boundaries re-balanced by time
(:func:`balanced_cuts`: torchtitan splits by layer count, not time, and an embedding or an LM
head is not a block), bounded until then by :func:`any_cuts_bound_ms`. Cuts of equal
``max_g T_g`` may differ in memory (the first chunks of the first groups hold the most
micro-batches in flight), so where the re-balanced plan's :func:`memory_floor_bytes` is over the
devices' memory, its boundaries are also moved until the floor is within it, at no larger
``max_g T_g`` (:func:`leaner_cuts`), and that plan is tried too. A chunk of width t > 1
must hold a shardable layer (``LayerProfile.tensor_parallel``; its t ranks would repeat its
work otherwise), as in the DP. Pure, no torch.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.cuts import rounded_to_chunks, with_cuts
from dapple.core.plan import Plan, interleave
from dapple.core.profile import ModelProfile
from dapple.cost.at_length import profile_for_plan
from dapple.cost.peak_memory import StageBytes, device_static, plan_stage_bytes
from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
from dapple.planner.grid import (
    INTERLEAVED,
    INTERLEAVED_CHUNKS,
    MAX_INTERLEAVED_ACTIONS,
    GridPoint,
    grid_points,
    point_plan,
    torchtitan_cuts,
)
from dapple.planner.scorer import Scorer
from dapple.planner.zero_modes import ZERO3_REGATHER, zero3_modes
from dapple.schedule.interleaved import interleaved_warmup

__all__ = [
    "ChunkStage",
    "Offer",
    "any_cuts_bound_ms",
    "balanced_cuts",
    "best_interleaved",
    "grid_offers",
    "group_work_ms",
    "leaner_cuts",
    "lower_bound_ms",
    "memory_floor_bytes",
    "own_offers",
    "regather_variants",
]

ChunkStage = tuple[int, int, int, int]
"""``(start, end, replicas, t)`` of one virtual stage: layers ``[start, end)`` on r replicas of
tensor width t."""

SLACK = 1e-9
"""Relative margin taken off every bound: a range's F + B summed layer by layer may differ from
the cost model's by rounding."""


@dataclass(frozen=True, slots=True)
class Offer:
    """One interleaved candidate: P device groups of v chunks each at M micro-batches of b
    samples; its plan is built only when costed."""

    chunks: tuple[ChunkStage, ...]
    """The virtual stages in chain order; virtual stage k runs on device group k mod P."""
    P: int
    v: int
    M: int
    b: int
    width: int
    """The tensor width of the search it is offered to (the tie-break among equal L)."""
    build: Callable[[], Plan]
    """Its plan at :attr:`chunks`' cuts, ZeRO-3 stages re-gathering as proposed."""

    @property
    def cuts(self) -> list[int]:
        """Chunk boundaries ``[0, c_1, ..., N]``."""
        return [c[0] for c in self.chunks] + [self.chunks[-1][1]]


class _LayerCosts:
    """F + B of each layer on the largest slice of a replica, per (t, samples), from the
    search's scorers (cached): the additive terms of :meth:`Scorer.fb_ms` layer by layer."""

    def __init__(self, scorers: Mapping[int, Scorer]) -> None:
        self.scorers = scorers
        self._by: dict[tuple[int, int], list[float]] = {}

    def prefix(self, t: int, n: int) -> list[float]:
        """Prefix sums over the layers of F + B at width t on n samples."""
        key = (t, n)
        if key not in self._by:
            sc, acc = self.scorers[t], [0.0]
            for i in range(sc.N):
                f, bw = sc.fb_ms(i, i + 1, n)
                acc.append(acc[-1] + f + bw)
            self._by[key] = acc
        return self._by[key]

    def groups(self, o: Offer) -> list[list[float]]:
        """Per device group g of ``o``, the prefix sums at its width and slice."""
        return [self.prefix(t, -(-o.b // r)) for _, _, r, t in o.chunks[: o.P]]


def group_work_ms(pre: Sequence[Sequence[float]], cuts: Sequence[int]) -> list[float]:
    """T_g: per device group g (P = ``len(pre)``), the F + B of its chunks (virtual stages g,
    g+P, ... between ``cuts``), from its prefix sums ``pre[g]``."""
    P = len(pre)
    work = [0.0] * P
    for k in range(len(cuts) - 1):
        g = k % P
        work[g] += pre[g][cuts[k + 1]] - pre[g][cuts[k]]
    return work


def lower_bound_ms(pre: Sequence[Sequence[float]], cuts: Sequence[int], v: int, M: int) -> float:
    """A lower bound of the interleaved step (:func:`~dapple.schedule.replay.replayed_step_ms`):
    ``max_g (M T_g + sum_{h<g} (F + B of stage h))`` (:func:`group_work_ms`), T_g without
    re-computation or ZeRO-3 gathers. Group g starts with chunk 0 of micro-batch 0, after the
    forwards of the stages h < g, works ``M T_g`` and ends with chunk 0's backward of the last
    micro-batch, before theirs; for equal chunks it is ``(M + (P-1)/v) T``, section 2.2.2's
    bubble."""
    P = len(pre)
    work = group_work_ms(pre, cuts)
    head, best = 0.0, 0.0
    for g in range(P):
        best = max(best, M * work[g] + head)
        head += pre[g][cuts[g + 1]] - pre[g][cuts[g]]
    return best * (1 - SLACK)


def any_cuts_bound_ms(pre: Sequence[Sequence[float]], v: int, M: int) -> float:
    """A lower bound of :func:`lower_bound_ms` over every chunking: each layer costs at least
    its cheapest group's time, so ``max_g T_g`` is at least a P-th of their sum and at least
    the largest."""
    P, N = len(pre), len(pre[0]) - 1
    least = [min(p[i + 1] - p[i] for p in pre) for i in range(N)]
    return M * max(sum(least) / P, max(least)) * (1 - SLACK)


def balanced_cuts(pre: Sequence[Sequence[float]], cuts: Sequence[int]) -> list[int]:
    """Chunk boundaries lowering ``max_g T_g`` (then the sum of the T_g squared): a hill climb
    from ``cuts`` moving one boundary by one layer at a time, the first move that improves
    taken, at most 4 N rounds (N layers)."""
    P, out = len(pre), list(cuts)
    work = group_work_ms(pre, out)

    def key(w: Sequence[float]) -> tuple[float, float]:
        return max(w), sum(x * x for x in w)

    best = key(work)
    for _ in range(4 * (out[-1] + 1)):
        improved = False
        for k in range(1, len(out) - 1):
            a, c = (k - 1) % P, k % P
            for layer, to, frm, cut in ((out[k] - 1, c, a, out[k] - 1), (out[k], a, c, out[k] + 1)):
                if not out[k - 1] < cut < out[k + 1]:
                    continue
                moved = list(work)
                moved[frm] -= pre[frm][layer + 1] - pre[frm][layer]
                moved[to] += pre[to][layer + 1] - pre[to][layer]
                if key(moved) < best:
                    out[k], work, best, improved = cut, moved, key(moved), True
                    break
        if not improved:
            break
    return out


def leaner_cuts(
    pre: Sequence[Sequence[float]],
    cuts: Sequence[int],
    floor: Callable[[list[int]], float],
    target: float,
) -> list[int]:
    """Chunk boundaries with ``floor`` (a plan's memory at those cuts) at most ``target``, or as
    low as reached, and ``max_g T_g`` no larger than at ``cuts``: a hill climb from ``cuts``, the
    first move that lowers ``floor`` taken, until it is within ``target``, at most 4 N rounds (N
    layers). The moves: boundaries k and k + P together in opposite directions by one layer (a
    layer each way between the groups on either side of them, which keeps both T_g where the
    two layers cost the same), then one boundary by one layer."""
    P, out = len(pre), list(cuts)
    cap = max(group_work_ms(pre, out)) * (1 + SLACK)
    least = floor(out)
    moves: list[tuple[tuple[int, int], ...]] = [
        ((k, d), (k + P, -d)) for k in range(1, len(out) - 1 - P) for d in (-1, 1)
    ]
    moves += [((k, d),) for k in range(1, len(out) - 1) for d in (-1, 1)]
    for _ in range(4 * (out[-1] + 1)):
        if least <= target:
            break
        improved = False
        for move in moves:
            cand = list(out)
            for k, d in move:
                cand[k] += d
            if any(b <= a for a, b in itertools.pairwise(cand)):
                continue
            if max(group_work_ms(pre, cand)) > cap:
                continue
            got = floor(cand)
            if got < least:
                out, least, improved = cand, got, True
                break
        if not improved:
            break
    return out


def _shards(profile: ModelProfile, chunks: Sequence[ChunkStage]) -> bool:
    """Every chunk of width t > 1 holds a shardable layer."""
    tp = [x.tensor_parallel for x in profile.layers]
    return all(t == 1 or any(tp[s:e]) for s, e, _, t in chunks)


def _at_cuts(o: Offer, cuts: Sequence[int]) -> tuple[ChunkStage, ...]:
    return tuple((cuts[k], cuts[k + 1], r, t) for k, (_, _, r, t) in enumerate(o.chunks))


def best_interleaved(
    offers: Sequence[Offer],
    scorers: Mapping[int, Scorer],
    profile: ModelProfile,
    cluster: Cluster,
    below_ms: float,
) -> tuple[float, int, Plan] | None:
    """The plan of least L below ``below_ms`` that fits device memory, as ``(L, width, plan)``
    with ``predicted_step_ms`` = L; None when there is none.

    Best first by lower bound (module docstring), each offer at its own cuts and re-cut by
    :func:`balanced_cuts` (bounded by :func:`any_cuts_bound_ms` until re-cut), and, when that
    plan is reached and its memory floor is over the devices', at :func:`leaner_cuts`' cuts
    (:func:`_leaner`, ranked by their own bound); a plan is costed
    by :func:`~dapple.cost.schedule_step.schedule_latency` while its bound is below the best L found,
    and its memory replayed (:func:`~dapple.cost.schedule_step.device_memory_by_group`) while its L
    is, its regather variants in turn (:func:`regather_variants`).
    """
    costs = _LayerCosts(scorers)
    heap: list[tuple[float, int, int, list[int] | None]] = []  # (bound, width, entry, cuts)
    entries = itertools.count()
    offer_of: dict[int, Offer] = {}
    recut: set[int] = set()  # the entries at balanced_cuts' cuts
    usable = cluster.usable_memory_bytes

    def push(bound: float, o: Offer, cuts: list[int] | None) -> int:
        n = next(entries)
        offer_of[n] = o
        heapq.heappush(heap, (bound, o.width, n, cuts))
        return n

    for o in offers:
        pre = costs.groups(o)
        push(lower_bound_ms(pre, o.cuts, o.v, o.M), o, o.cuts)
        push(any_cuts_bound_ms(pre, o.v, o.M), o, None)
    best: tuple[float, int, Plan] | None = None
    limit = below_ms
    while heap and heap[0][0] < limit:
        _, width, n, cuts = heapq.heappop(heap)
        o = offer_of.pop(n)
        if cuts is None:  # re-cut, then ranked by its own bound
            pre = costs.groups(o)
            new = balanced_cuts(pre, o.cuts)
            if _shards(profile, _at_cuts(o, new)):
                recut.add(push(lower_bound_ms(pre, new, o.v, o.M), o, new))
            continue
        plan = o.build() if cuts == o.cuts else with_cuts(o.build(), cuts)
        if n in recut:  # over memory: also the leaner cuts, ranked by their own bound
            pre = costs.groups(o)
            lean = _leaner(pre, plan, profile, usable)
            if lean is not None and _shards(profile, _at_cuts(o, lean)):
                push(lower_bound_ms(pre, lean, o.v, o.M), o, lean)
            if cuts == o.cuts:
                continue  # costed at its own cuts
        for variant in regather_variants(plan, ZERO3_REGATHER in zero3_modes(profile)):
            L = _fitting_ms(variant, profile, cluster, limit)
            if L is not None:
                best, limit = (L, width, dataclasses.replace(variant, predicted_step_ms=L)), L
                break
    return best


def _leaner(
    pre: Sequence[Sequence[float]], plan: Plan, profile: ModelProfile, usable: float
) -> list[int] | None:
    """The cuts of :func:`leaner_cuts` from ``plan``'s, where the memory floor
    (:func:`memory_floor_bytes`) of ``plan`` gathering once per step (its first
    :func:`regather_variants`) is over ``usable``; None where it is not, or no move lowers it."""
    floor = _floor_at(next(regather_variants(plan)), profile)
    cuts = [s.layers[0] for s in plan.stages] + [plan.num_layers]
    if floor(cuts) <= usable:
        return None
    lean = leaner_cuts(pre, cuts, floor, usable)
    return None if lean == cuts else lean


def _fitting_ms(
    plan: Plan, profile: ModelProfile, cluster: Cluster, below_ms: float
) -> float | None:
    """L of ``plan`` when below ``below_ms`` and its replayed memory is within the devices',
    else None (the replay skipped where :func:`memory_floor_bytes` is already over)."""
    usable = cluster.usable_memory_bytes
    if memory_floor_bytes(plan, profile) > usable:
        return None
    step_ms = schedule_latency(plan, profile, cluster)
    if step_ms >= below_ms or max(device_memory_by_group(plan, profile)) > usable:
        return None
    return step_ms


def memory_floor_bytes(plan: Plan, profile: ModelProfile) -> float:
    """A lower bound of the largest :func:`~dapple.cost.schedule_step.device_memory_by_group` of an
    interleaved plan without its replay: per device group, its always-held state and the
    bytes held by the forwards it runs before its first backward (its warm-up,
    :func:`~dapple.schedule.interleaved.interleaved_warmup`, and one more), forward n of
    chunk ``(n // P) mod v`` (:func:`~dapple.cost.peak_memory.device_peak` reaches that level
    before any gradient exists)."""
    memory = profile_for_plan(profile, plan)
    return _floor(plan, [plan_stage_bytes(memory, s, plan.micro_batch_size) for s in plan.stages])


def _floor(plan: Plan, parts: Sequence[StageBytes]) -> float:
    """:func:`memory_floor_bytes` of ``plan`` given each (virtual) stage's bytes ``parts``."""
    P, v, M = plan.num_groups, plan.virtual_stages, plan.num_micro_batches
    worst = 0.0
    for g, w in enumerate(interleaved_warmup(P, M, v)):
        mine = parts[g::P]
        cycles, rest = divmod(min(w + 1, M * v), P * v)  # forwards before the first backward
        held = sum(
            (cycles * P + min(max(rest - c * P, 0), P)) * sb.other for c, sb in enumerate(mine)
        )
        worst = max(worst, device_static(mine) + held)
    return worst


def _floor_at(plan: Plan, profile: ModelProfile) -> Callable[[list[int]], float]:
    """:func:`memory_floor_bytes` of ``plan`` at other chunk boundaries, each (virtual) stage's
    bytes computed once per layer range."""
    memory = profile_for_plan(profile, plan)
    known: dict[tuple[int, int, int], StageBytes] = {}

    def part(k: int, start: int, end: int) -> StageBytes:
        if (k, start, end) not in known:
            stage = dataclasses.replace(plan.stages[k], layers=(start, end))
            known[k, start, end] = plan_stage_bytes(memory, stage, plan.micro_batch_size)
        return known[k, start, end]

    def floor(cuts: list[int]) -> float:
        return _floor(plan, [part(k, cuts[k], cuts[k + 1]) for k in range(len(cuts) - 1)])

    return floor


def regather_variants(plan: Plan, regather: bool = True) -> Iterator[Plan]:
    """``plan`` with its ZeRO-3 stages gathering once per step, as proposed, then (with
    ``regather``) re-gathering per micro-batch (each distinct variant once; ``plan`` alone
    without ZeRO-3 stages)."""
    seen = set()
    for mode in (False, None, True) if regather else (False, None):  # None: as proposed
        stages = tuple(
            dataclasses.replace(s, regather=s.regather if mode is None else mode)
            if s.parallel.shards_params
            else s
            for s in plan.stages
        )
        if stages not in seen:
            seen.add(stages)
            yield plan if stages == plan.stages else dataclasses.replace(plan, stages=stages)


def grid_offers(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    widths: Sequence[int],
    micro_batches: Sequence[int],
    accept: Callable[[GridPoint], bool],
) -> list[Offer]:
    """The interleaved grid points at ``micro_batches`` that ``accept`` takes, of a width
    among ``widths`` (module docstring), as offers of ``planner="dapple"`` plans."""
    B, out = global_batch_size, []
    for p in grid_points(profile, cluster, B, micro_batches=micro_batches):
        if p.schedule != INTERLEAVED or p.tp not in widths or not accept(p):
            continue
        cuts = torchtitan_cuts(profile.num_layers, p.pp * p.v)
        chunks = tuple((cuts[k], cuts[k + 1], p.dp, p.tp) for k in range(p.pp * p.v))
        if _shards(profile, chunks):
            out.append(Offer(chunks, p.pp, p.v, p.M, B // p.M, p.tp, _grid_plan(profile, B, p)))
    return out


def _grid_plan(profile: ModelProfile, B: int, p: GridPoint) -> Callable[[], Plan]:
    def build() -> Plan:
        plan = point_plan(profile, B, p, (False,) * (p.pp * p.v), math.nan)
        return dataclasses.replace(plan, planner="dapple")

    return build


def own_offers(
    plans: Iterable[tuple[int, Plan]], profile: ModelProfile, widths: Sequence[int],
    micro_batches: Sequence[int],
) -> list[Offer]:  # fmt: skip
    """Each ``(width, plan)`` of the search interleaved (module docstring), at every M of
    ``micro_batches`` the schedule takes, for each v of
    :data:`~dapple.planner.grid.INTERLEAVED_CHUNKS`; plans of equal stages (at other M) once."""
    out, seen = [], set()
    for (t, plan), v in itertools.product(plans, INTERLEAVED_CHUNKS):
        base = _chunkable(plan, v)
        if base is None or any(s.tensor_width not in widths for s in base.stages):
            continue
        chunked = dataclasses.replace(interleave(base, v), policy="A")
        chunks = tuple((*s.layers, s.replicas, s.tensor_width) for s in chunked.stages)
        P = chunked.num_groups
        if chunked.stages in seen or not _shards(profile, chunks):
            continue  # the same stages come once (at every M)
        seen.add(chunked.stages)
        for M in micro_batches:
            if M % P == 0 and M * P * v <= MAX_INTERLEAVED_ACTIONS:
                b = plan.global_batch_size // M
                out.append(Offer(chunks, P, v, M, b, t, _own_plan(chunked, M, b)))
    return out


def _own_plan(chunked: Plan, M: int, b: int) -> Callable[[], Plan]:
    def build() -> Plan:
        return dataclasses.replace(chunked, num_micro_batches=M, micro_batch_size=b)

    return build


def _chunkable(plan: Plan, v: int) -> Plan | None:
    """``plan`` (one stage per device group, at least two groups) with v dividing every group's
    layers (:func:`~dapple.core.plan.rounded_to_chunks`); None when it cannot."""
    return rounded_to_chunks(plan, v) if plan.num_stages >= 2 else None
