"""Per-stage tensor widths t_i: a local search from the plans of the uniform-width searches.

Each uniform-width search (:mod:`dapple.planner.widths`, one run of the DAPPLE DP per t) gives a
plan whose stages all have width t. :func:`refine_stage_widths` improves such a plan one move at
a time, keeping a move only when the whole plan's L (equations 1-3, scored as the DP scores it:
:class:`MixedScorer`) drops and every stage fits memory:

* width: re-split one stage's own devices into r' tensor groups of width t' (r' x t' = its
  device count, t' among the searched widths);
* cut: move the boundary between two stages by one layer; a stage left with no shardable layer
  (``LayerProfile.tensor_parallel``) drops to t = 1 on the same devices;
* merge: two neighbouring stages become one on the union of their devices, at each width;
* shift (only where none of the above improves): a stage moved by one layer, its length kept.

Each round takes the best improving move (the first of least L); the rounds stop when none
improves, then M is re-picked among the candidates and the rounds repeat until M stays. A
round estimates all its moves at once (:mod:`dapple.planner.move_scores`) and scores whole,
lowest estimate first, only those whose estimate may still beat the best scored. A stage of width t keeps
its tensor groups aligned, each ``t`` consecutive devices starting at a multiple of t, so
inside one server (t divides the server size) and on the tensor groups the width-t
:class:`~dapple.planner.scorer.Scorer` represents: its cached terms cost the stage, and the
plan records exactly what was scored. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from dapple.core.plan import DEFAULT_SCHEDULE, Plan
from dapple.cost.comm import busiest_link_ms, link_loads
from dapple.cost.host import has_host_terms, stage_host_extras
from dapple.cost.memory import boundary_bytes
from dapple.planner.move_scores import ROUNDING, Move, Row, WidthStage, estimate_moves, stage_row
from dapple.planner.scorer import Scored, Scorer, score_options, scored_plan
from dapple.planner.shares import kind_shares
from dapple.planner.stage_options import StageOptions
from dapple.planner.widths import TensorSums
from dapple.planner.zero_modes import UNSHARDED
from dapple.schedule.registry import get_schedule

__all__ = ["MixedScorer", "applied", "moves_of", "refine_stage_widths", "regroup", "shift_moves"]

MAX_ROUNDS_PER_LAYER = 4
"""The moves of one M stop after this many rounds per layer (each round lowers L)."""


def regroup(devices: Sequence[int], t: int) -> tuple[int, ...] | None:
    """``devices`` in increasing order as tensor groups of width t, each t consecutive devices
    starting at a multiple of t; None when they do not form such groups."""
    d = sorted(devices)
    if len(d) % t:
        return None
    for j in range(0, len(d), t):
        if d[j] % t or d[j + t - 1] != d[j] + t - 1:
            return None
    return tuple(d)


class MixedScorer:
    """Scores plans whose stages have their own widths, from the width-t scorers' cached terms.

    A stage of width t is costed by ``scorers[t]`` (F, B, AR_s, U_s, memory, zero stage and
    re-computation options, :meth:`Scorer.stage_options`); a comm stage between two stages of
    one width t as ``scorers[t]`` costs it, between widths by the split-concat between their
    tensor groups' first devices (:func:`~dapple.cost.comm.comm_stage_ms`). A plan of one width
    t scores as ``scorers[t]`` scores it.
    """

    def __init__(self, scorers: Mapping[int, Scorer]) -> None:
        self.scorers = dict(scorers)
        one = next(iter(self.scorers.values()))
        self.profile = one.profile
        self.cluster = one.real_cluster
        self.global_batch_size = one.global_batch_size
        self.N = one.N
        self.widths = sorted(self.scorers)
        self._shardable = TensorSums(self.profile, self.cluster, 1)
        self._links: dict[tuple[object, ...], list[tuple[float, float]]] = {}
        self._options: dict[tuple[WidthStage, int], StageOptions] = {}
        """Each stage's options at b samples (:meth:`Scorer.stage_options`): a local search's
        candidates differ from the current plan in one or two stages, the rest are looked up."""
        self._comms: dict[tuple[object, ...], float] = {}
        """Each comm stage's time by ``(cut, devices, t, devices, t, b, shares, shares)``
        (:meth:`_comm_ms`)."""
        self._rows: dict[tuple[WidthStage, int, int], Row] = {}
        """Each stage's :data:`~dapple.planner.move_scores.Row` by ``(stage, b, K_i)``."""
        self._spec = get_schedule(DEFAULT_SCHEDULE)

    def shards(self, s: int, e: int) -> bool:
        """Whether layers ``[s, e)`` hold a shardable layer."""
        return self._shardable.blocks(s, e) > 0

    def score(self, stages: Sequence[WidthStage], M: int) -> Scored | None:
        """L of the candidate under the default schedule, or None when it does not fit memory
        (or a stage of width t > 1 has no shardable layer)."""
        b = self.global_batch_size // M
        options = []
        for st in stages:
            opts = self._stage_options(st, b)
            if not opts:
                return None
            options.append(opts)
        comm = [self._comm_ms(stages[i], stages[i + 1], b) for i in range(len(stages) - 1)]
        extras = (
            stage_host_extras(
                self.profile, self.cluster, [(s, e, len(d) // t) for s, e, d, t in stages], b
            )
            if has_host_terms(self.cluster)
            else None
        )
        return score_options(options, comm, extras, M, self.cluster, DEFAULT_SCHEDULE, self._spec)

    def estimates(
        self, stages: Sequence[WidthStage], moves: Sequence[Move], M: int
    ) -> list[float] | None:
        """Each move's L from ``stages`` at M within
        :data:`~dapple.planner.move_scores.ROUNDING` of :meth:`score`'s (``inf``: it does
        not fit), all at once (:func:`~dapple.planner.move_scores.estimate_moves`); None on a
        cluster with host terms, whose CPU-host pass the estimate does not run, or under a
        default schedule other than DAPPLE's, whose in-flight counts it assumes."""
        if has_host_terms(self.cluster) or self._spec.name != "dapple":
            return None
        b = self.global_batch_size // M
        spec = self._spec
        return estimate_moves(
            stages,
            moves,
            M,
            lambda st, k: self._row(st, b, k),
            lambda src, dst: self._comm_ms(src, dst, b),
            spec.name,
            ("A", "B") if len(spec.policies) > 1 else spec.policies,
        )

    def _row(self, st: WidthStage, b: int, k: int) -> Row:
        """Stage ``st``'s terms at b samples holding k micro-batches
        (:func:`~dapple.planner.move_scores.stage_row`), remembered."""
        key = (st, b, k)
        got = self._rows.get(key)
        if got is None:
            opts = self._stage_options(st, b)
            M = self.global_batch_size // b
            got = self._rows[key] = stage_row(opts, k, M, self._spec.bounded)
        return got

    def _stage_options(self, st: WidthStage, b: int) -> StageOptions:
        """The options of stage ``st`` at b samples (:meth:`Scorer.stage_options`)."""
        got = self._options.get((st, b))
        if got is None:
            s, e, d, t = st
            got = self._options[st, b] = self.scorers[t].stage_options(s, e, _groups(d, t), b)
        return got

    def _comm_ms(self, src: WidthStage, dst: WidthStage, b: int) -> float:
        """The comm stage across the cut ``src | dst``."""
        (s0, cut, d0, t0), (_, e1, d1, t1) = src, dst
        g0, g1 = _groups(d0, t0), _groups(d1, t1)
        x0 = kind_shares(self.scorers[t0], s0, cut, g0, b)  # None: even (no device kinds)
        x1 = kind_shares(self.scorers[t1], cut, e1, g1, b)
        key = (cut, d0, t0, d1, t1, b, x0, x1)
        got = self._comms.get(key)
        if got is None:
            got = self._comms[key] = self._comm_stage_ms(cut, d0, t0, d1, t1, b, x0, x1)
        return got

    def _comm_stage_ms(
        self,
        cut: int,
        d0: tuple[int, ...],
        t0: int,
        d1: tuple[int, ...],
        t1: int,
        b: int,
        x0: tuple[int, ...] | None,
        x1: tuple[int, ...] | None,
    ) -> float:
        """The comm stage across ``cut`` from ``d0`` at width t0 to ``d1`` at t1, the slices
        ``x0`` and ``x1`` (None: even): as the width's scorer costs it for one width, else the
        split-concat between the tensor groups' first devices."""
        g0, g1 = _groups(d0, t0), _groups(d1, t1)
        if t0 == t1:
            return self.scorers[t0].comm_ms(cut, g0, g1, b, x0, x1)
        key = (d0[::t0], d1[::t1], b, x0, x1)
        links = self._links.get(key)
        if links is None:
            links = self._links[key] = link_loads(self.cluster, *key)
        return busiest_link_ms(links, boundary_bytes(self.profile, cut, 1))

    def build_plan(
        self, planner: str, stages: Sequence[WidthStage], M: int, scored: Scored
    ) -> Plan:
        """The :class:`Plan` of a scored candidate, with ``predicted_step_ms`` = L."""
        zs = scored.zero_modes or [UNSHARDED] * len(stages)
        bare = [
            self.scorers[t].stage_plan(s, e, _groups(d, t), z if len(d) > t else UNSHARDED)
            for (s, e, d, t), z in zip(stages, zs, strict=True)
        ]
        return scored_plan(planner, self.profile, self.global_batch_size, bare, M, scored)


def _groups(devices: tuple[int, ...], t: int) -> tuple[int, ...]:
    """The tensor groups of width t (ids of :func:`~dapple.planner.widths.group_cluster`)."""
    return devices if t == 1 else tuple(d // t for d in devices[::t])


def _width_moves(ms: MixedScorer, stages: list[WidthStage]) -> Iterator[Move]:
    """Each stage's devices re-split at each other width."""
    for i, (s, e, d, t) in enumerate(stages):
        for t2 in ms.widths:
            d2 = regroup(d, t2) if t2 != t else None
            if d2 is not None:
                yield i, i + 1, ((s, e, d2, t2),)


def _narrowed(ms: MixedScorer, st: WidthStage) -> WidthStage:
    """``st``, at t = 1 when it has no shardable layer (and 1 is a searched width)."""
    s, e, d, t = st
    if t == 1 or ms.shards(s, e) or 1 not in ms.scorers:
        return st
    return (s, e, tuple(sorted(d)), 1)


def _cut_moves(ms: MixedScorer, stages: list[WidthStage]) -> Iterator[Move]:
    """Each boundary moved by one layer (:func:`_narrowed`)."""
    for i in range(len(stages) - 1):
        (s0, c, d0, t0), (_, e1, d1, t1) = stages[i], stages[i + 1]
        for cut in (c - 1, c + 1):
            if s0 < cut < e1:
                a = _narrowed(ms, (s0, cut, d0, t0))
                z = _narrowed(ms, (cut, e1, d1, t1))
                yield i, i + 2, (a, z)


def _merge_moves(ms: MixedScorer, stages: list[WidthStage]) -> Iterator[Move]:
    """Each two neighbouring stages as one on their devices, at each width."""
    for i in range(len(stages) - 1):
        (s0, _, d0, _), (_, e1, d1, _) = stages[i], stages[i + 1]
        for t in ms.widths:
            d = regroup((*d0, *d1), t)
            if d is not None:
                yield i, i + 2, ((s0, e1, d, t),)


def moves_of(ms: MixedScorer, stages: list[WidthStage]) -> list[Move]:
    """A round's moves from ``stages`` (module docstring), in the order the round weighs
    them: width, cut, merge."""
    return [*_width_moves(ms, stages), *_cut_moves(ms, stages), *_merge_moves(ms, stages)]


def applied(stages: Sequence[WidthStage], move: Move) -> list[WidthStage]:
    """The plan ``move`` makes of ``stages``."""
    i, j, new = move
    return [*stages[:i], *new, *stages[j:]]


def shift_moves(ms: MixedScorer, stages: list[WidthStage]) -> list[Move]:
    """Each stage with a neighbour on either side moved by one layer, its length kept: the two
    boundaries around it moved together, which no one cut move reaches when each alone raises
    L (:func:`_narrowed` applied to the three stages)."""
    out: list[Move] = []
    for i in range(1, len(stages) - 1):
        (s0, a, d0, t0), (_, c, d1, t1), (_, e2, d2, t2) = stages[i - 1 : i + 2]
        for delta in (-1, 1):
            if s0 < a + delta and c + delta < e2:
                new = ((s0, a + delta, d0, t0), (a + delta, c + delta, d1, t1),
                       (c + delta, e2, d2, t2))  # fmt: skip
                out.append((i - 1, i + 2, tuple(_narrowed(ms, st) for st in new)))
    return out


def _climb(
    ms: MixedScorer, stages: list[WidthStage], M: int, best: Scored
) -> tuple[list[WidthStage], Scored]:
    """Rounds of the best improving move (module docstring) at M until none improves: the
    first move of least L below the current plan's (:func:`_best_move`); where none of a
    round's moves improves, the first of least L of its :func:`shift_moves`."""
    for _ in range(MAX_ROUNDS_PER_LAYER * ms.N):
        found = _best_move(ms, stages, moves_of(ms, stages), M, best)
        if found is None:
            found = _best_move(ms, stages, shift_moves(ms, stages), M, best)
        if found is None:
            break
        stages, best = found
    return stages, best


def _best_move(
    ms: MixedScorer, stages: list[WidthStage], moves: Sequence[Move], M: int, best: Scored
) -> tuple[list[WidthStage], Scored] | None:
    """The plan of the first move of least L below ``best``'s and its score; None when none is
    below. Where :meth:`MixedScorer.estimates` applies, only the moves whose estimate may beat
    the best scored so far are scored."""
    est = ms.estimates(stages, moves, M)
    order = range(len(moves)) if est is None else sorted(range(len(moves)), key=est.__getitem__)
    found: tuple[int, Scored] | None = None
    for m in order:
        bar = (found[1] if found else best).L_ms
        if est is not None and est[m] >= bar * (1 + ROUNDING):
            break  # this move and the rest are above the best by more than rounding
        got = ms.score(applied(stages, moves[m]), M)
        if got is not None and (got.L_ms < bar or (found and got.L_ms == bar and m < found[0])):
            found = (m, got)
    if found is None:
        return None
    return applied(stages, moves[found[0]]), found[1]


def refine_stage_widths(
    ms: MixedScorer, stages: Sequence[WidthStage], M: int, Ms: Sequence[int]
) -> tuple[list[WidthStage], int, Scored] | None:
    """The local search of the module docstring from ``stages`` at M.

    Args:
        ms: the scorer of mixed widths.
        stages: the starting plan, every stage's groups aligned (:func:`regroup`).
        M: its micro-batch count.
        Ms: the candidate M to re-pick from.

    Returns:
        ``(stages, M, scored)`` of the best plan found (the start when no move improves), or
        None when the start does not fit.
    """
    best = ms.score(stages, M)
    if best is None:
        return None
    cur = list(stages)
    while True:
        cur, best = _climb(ms, cur, M, best)
        picked = M
        for m in Ms:
            got = ms.score(cur, m)
            if got is not None and got.L_ms < best.L_ms:
                picked, best = m, got
        if picked == M:
            return cur, M, best
        M = picked
