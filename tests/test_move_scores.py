"""The local search's estimates of its moves (:mod:`dapple.planner.move_scores`) against
brute force: every move of random plans scored whole by :meth:`MixedScorer.score`, and the
climb that scores only the moves its estimates keep against one that scores every move."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.profile import ModelProfile
from dapple.planner.move_scores import ROUNDING, Move, WidthStage, _in_flight
from dapple.planner.scorer import Scorer
from dapple.planner.stage_widths import MixedScorer, applied, moves_of, refine_stage_widths
from dapple.schedule.registry import in_flight_counts

GIB = 1024**3


def _cluster(memory_gib: float) -> Cluster:
    """Two servers of four devices, slower between servers."""
    return Cluster(
        name="moves-test",
        servers=2,
        devices_per_server=4,
        device_memory_bytes=int(memory_gib * GIB),
        intra_server_bandwidth_gbps=100.0,
        inter_server_bandwidth_gbps=25.0,
        intra_server_latency_ms=0.01,
        inter_server_latency_ms=0.02,
    )


def _profile(times: Sequence[float]) -> ModelProfile:
    """A layer per time (F = t, B = 2t ms per sample), the first not shardable; parameters and
    kept activations large enough that memory asks for ZeRO, re-computation or a bound D."""
    return ModelProfile(
        model_name="moves",
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=0.05, per_sample_ms=t),
                backward=AffineTime(fixed_ms=0.1, per_sample_ms=2 * t),
                output_bytes_per_sample=2e6,
                parameter_bytes=int(4e8 * t) * (i > 0),
                kept_activation_bytes_per_sample=4e7 * t,
                tensor_parallel=i > 0,
            )
            for i, t in enumerate(times)
        ),
    )


@st.composite
def _cases(draw: st.DrawFn) -> tuple[MixedScorer, list[WidthStage], int]:
    """A mixed scorer on a random profile and memory, and a plan of aligned stages on it."""
    n = draw(st.integers(3, 8))
    times = draw(st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5]), min_size=n, max_size=n))
    memory = draw(st.sampled_from([1.5, 2.0, 4.0, 8.0, 64.0]))
    B = draw(st.sampled_from([8, 16, 32]))
    prof, cluster = _profile(times), _cluster(memory)
    ms = MixedScorer({t: Scorer(prof, cluster, B, "auto", t) for t in (1, 2, 4)})
    k = draw(st.integers(1, min(n, 4)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1)))
    bounds = [0, *cuts, n]
    sizes = [draw(st.sampled_from([1, 2, 4])) for _ in range(k)]
    while sum(sizes) > 8:
        sizes[sizes.index(max(sizes))] //= 2
    stages: list[WidthStage] = []
    at = 0
    for i, r in enumerate(sizes):
        d = tuple(range(at, at + r))
        at += r
        t = draw(st.sampled_from([t for t in (1, 2, 4) if r % t == 0 and at % t == 0]))
        t = t if all(x % t == 0 for x in d[::t]) and d[0] % t == 0 else 1
        stages.append((bounds[i], bounds[i + 1], d, t))
    M = draw(st.sampled_from([m for m in (1, 2, 4, 8) if B % m == 0]))
    return ms, stages, M


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_each_move_is_estimated_as_the_whole_plan_scores(
    case: tuple[MixedScorer, list[WidthStage], int],
) -> None:
    """Every move of a random plan (width, cut, merge) at its M: the estimate is ``inf``
    exactly where the whole plan does not fit, else within :data:`ROUNDING` of its L."""
    ms, stages, M = case
    _assert_estimated(ms, stages, M)


def _assert_estimated(ms: MixedScorer, stages: list[WidthStage], M: int) -> int:
    """Every move's estimate against its whole plan's score; how many of those plans bound a
    stage by D."""
    moves = moves_of(ms, stages)
    est = ms.estimates(stages, moves, M)
    assert est is not None and len(est) == len(moves)
    bound = 0
    for move, got in zip(moves, est, strict=True):
        whole = ms.score(applied(stages, move), M)
        if whole is None:
            assert got == float("inf"), move
        else:
            assert abs(got - whole.L_ms) <= ROUNDING * whole.L_ms, (move, got, whole.L_ms)
            bound += any(d is not None for d in whole.max_in_flight)
    return bound


def test_a_move_whose_plan_bounds_a_stage_by_d_is_estimated_with_it() -> None:
    """1.5 GiB devices: one move's plan keeps a stage below its K_i (D, the DAPPLE schedule's
    counts under it); its estimate is its L all the same."""
    prof, cluster = _profile([0.5, 1.0, 1.0, 1.0, 1.0, 0.5]), _cluster(1.5)
    ms = MixedScorer({t: Scorer(prof, cluster, 16, "auto", t) for t in (1, 2, 4)})
    stages = [(0, 2, (0, 1), 1), (2, 4, (2, 3), 2), (4, 6, (4, 5, 6, 7), 4)]
    assert _assert_estimated(ms, stages, 4) >= 1


class _EveryMove(MixedScorer):
    """Scores every move whole (no estimates), in the round's order: the climb before its
    estimates."""

    def estimates(
        self, stages: Sequence[WidthStage], moves: Sequence[Move], M: int
    ) -> list[float] | None:
        return None


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_the_climb_finds_what_scoring_every_move_finds(
    case: tuple[MixedScorer, list[WidthStage], int],
) -> None:
    """The local search that scores only the moves its estimates keep ends where the one that
    scores every move ends: the same stages, M and L."""
    ms, stages, M = case
    brute = _EveryMove(ms.scorers)
    Ms = [m for m in (1, 2, 4, 8) if ms.global_batch_size % m == 0]
    assert refine_stage_widths(ms, stages, M, Ms) == refine_stage_widths(brute, stages, M, Ms)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 16),
    st.sampled_from(["A", "B"]),
    st.data(),
)
def test_dapple_in_flight_counts_share_a_binding_d(
    S: int, M: int, policy: str, data: st.DataObject
) -> None:
    """The estimates' rule for K_i under a bound D (:func:`estimate_moves`) is the DAPPLE
    schedule's: the running minimum of its counts without D and D, and after a stage s whose
    own D_s binds, at most ``ceil(D_s (S-t) / (S-s))`` at stage t."""
    D = data.draw(st.lists(st.none() | st.integers(1, 20), min_size=S, max_size=S))
    nominal = in_flight_counts("dapple", S, M, policy)
    want: list[int] = []
    for t, (k, d) in enumerate(zip(nominal, D, strict=True)):
        shares = [
            math.ceil(ds * (S - t) / (S - s))
            for s, ds in enumerate(D[:t])
            if ds is not None and want[s] == ds < nominal[s]
        ]
        want.append(min([k, *([d] if d else []), *want[-1:], *shares]))
    assert in_flight_counts("dapple", S, M, policy, D) == want
    binds = [d if d is not None and d < k else 0 for k, d in zip(nominal, D, strict=True)]
    got = _in_flight(np.array(nominal)[:, None], np.array(binds)[:, None])
    assert got[:, 0].tolist() == want
