"""The search prices a mixed cluster's plans as the cost model does (issue #43): a stage's
replicas take their balanced shares of the micro-batch (:mod:`dapple.planner.shares`), at their
kind's speed or from their kind's own profile, and the split-concat on either side of it moves
those shares, not an even split."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from builders import make_profile
from dapple.core.cluster import GIB, Cluster
from dapple.core.device_kinds import DeviceKind
from dapple.core.kind_profiles import fastest_layers, with_kind_profiles
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.planner import dapple_search
from dapple.planner.scorer import Scorer, StageSpec
from dapple.planner.shares import kind_shares, search_cluster, with_kind_shares


def _cluster(per_server: int, slow: float, intra: float, inter: float) -> Cluster:
    kinds = (
        DeviceKind(name="fast", servers=1, speed=1.0, device_memory_bytes=GIB),
        DeviceKind(name="slow", servers=1, speed=slow, device_memory_bytes=GIB),
    )
    return Cluster(servers=2, devices_per_server=per_server, device_memory_bytes=GIB,
                   intra_server_bandwidth_gbps=intra, inter_server_bandwidth_gbps=inter,
                   kinds=kinds)  # fmt: skip


def _cost_model_ms(sc: Scorer, stages: list[StageSpec], M: int) -> tuple[float, float] | None:
    """The scorer's L of a candidate and the cost model's L of its plan with shares (None:
    the candidate does not fit memory)."""
    got = sc.score(stages, M)
    if got is None:
        return None
    plan = with_kind_shares(sc.build_plan("dapple", stages, M, got), sc.profile, sc.cluster)
    return got.L_ms, pipeline_latency(plan, sc.profile, sc.cluster).L_ms


def test_split_concat_moves_the_shares() -> None:
    """Stage 0 on a fast and a slow device (shares 6 and 2 of 8), stage 1 on a second fast
    device: 2 samples cross the slow 1 Gbps link between servers, not the even split's 4.
    Each sample's activations at the cut are 10 MB, 80 ms across that link; F + B of stage 1
    is 8 x 2 x (1 + 2) = 48 ms per micro-batch."""
    prof = make_profile(4, fwd=1.0, bwd=2.0, act=1e7, params=4000)
    sc = Scorer(prof, _cluster(2, 0.3, 100.0, 1.0), 16)
    stages: list[StageSpec] = [(0, 2, (0, 2)), (2, 4, (1,))]
    assert kind_shares(sc, 0, 2, (0, 2), 8) == (6, 2)
    assert kind_shares(sc, 2, 4, (1,), 8) is None
    comm = sc.comm_ms(2, (0, 2), (1,), 8, (6, 2), None)
    assert comm == pytest.approx(0.02 + 2 * 1e7 / (1e9 / 8 / 1e3))  # latency + 2 samples
    assert sc.comm_ms(2, (0, 2), (1,), 8) == pytest.approx(0.02 + 4 * 1e7 / (1e9 / 8 / 1e3))
    both = _cost_model_ms(sc, stages, 2)
    assert both is not None
    searched, cost = both
    assert searched == pytest.approx(cost, rel=1e-12)


_speeds = st.sampled_from([0.23, 0.37, 0.61, 0.83])
_factors = st.sampled_from([0.0, 1.0, 1.7, 3.1])
"""Per layer, how much slower the slow kind's own profile is (0.0 anywhere: no per-kind
profiles, the speed scales every layer)."""


def _own_profiles(c: Cluster, prof: ModelProfile, factors: list[float]) -> Cluster:
    """``c`` with the slow kind given its own profile, ``factors`` x ``prof``'s times per layer
    (``c`` itself when a factor is 0)."""
    if 0.0 in factors:
        return c
    slow = dataclasses.replace(
        prof,
        layers=tuple(
            dataclasses.replace(
                x,
                forward=dataclasses.replace(x.forward, per_sample_ms=x.forward.per_sample_ms * f),
                backward=dataclasses.replace(
                    x.backward, per_sample_ms=x.backward.per_sample_ms * f
                ),
            )
            for x, f in zip(prof.layers, factors, strict=True)
        ),
    )
    return with_kind_profiles(c, {"fast": prof, "slow": slow})


_bandwidths = st.sampled_from([(100.0, 1.0), (10.0, 10.0), (400.0, 0.5)])


@st.composite
def _candidates(draw: st.DrawFn) -> tuple[Scorer, list[StageSpec], int]:
    n = draw(st.integers(2, 6))
    per_server = draw(st.sampled_from([2, 3]))
    intra, inter = draw(_bandwidths)
    c = _cluster(per_server, draw(_speeds), intra, inter)
    prof = make_profile(n, fwd=1.3, bwd=2.7, act=draw(st.sampled_from([1e5, 1e6, 1e7])))
    c = _own_profiles(c, prof, draw(st.lists(_factors, min_size=n, max_size=n)))
    gbs = draw(st.sampled_from([8, 12, 16]))
    M = draw(st.sampled_from([m for m in (1, 2, 4) if gbs % m == 0]))
    S = draw(st.integers(1, min(3, n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=S - 1, max_size=S - 1)))
    order = draw(st.permutations(range(c.num_devices)))
    used = 0
    stages: list[StageSpec] = []
    for i, (s, e) in enumerate(zip([0, *cuts], [*cuts, n], strict=True)):
        k = draw(st.integers(1, c.num_devices - used - (S - 1 - i)))  # leave one for each next
        stages.append((s, e, tuple(order[used : used + k])))
        used += k
    return Scorer(prof, c, gbs), stages, M


@settings(max_examples=150, deadline=None)
@given(_candidates())
def test_scorer_equals_the_cost_model_on_any_candidate(
    cand: tuple[Scorer, list[StageSpec], int],
) -> None:
    """Any candidate on two kinds: the scorer's L is pipeline_latency of its plan given the
    shares (the comm stages included)."""
    sc, stages, M = cand
    both = _cost_model_ms(sc, stages, M)
    assume(both is not None)
    assert both is not None
    searched, cost = both
    assert searched == pytest.approx(cost, rel=1e-9)


def _search_case(n: int, per_server: int, slow: float, bw: tuple[float, float], act: float,
                 gbs: int) -> tuple[ModelProfile, Cluster]:  # fmt: skip
    return make_profile(n, fwd=1.3, bwd=2.7, act=act), _cluster(per_server, slow, *bw)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(3, 6),
    st.sampled_from([2, 3]),
    _speeds,
    _bandwidths,
    st.sampled_from([1e5, 1e6, 1e7]),
    st.sampled_from([8, 12, 16]),
    st.lists(_factors, min_size=6, max_size=6),
)
def test_search_score_is_pipeline_latency_of_its_plan(
    n: int,
    per_server: int,
    slow: float,
    bw: tuple[float, float],
    act: float,
    gbs: int,
    factors: list[float],
) -> None:
    """The DAPPLE search's own L (on :func:`search_cluster`, each layer at its fastest kind's
    time when the kinds have their own profiles) equals pipeline_latency of the plan it
    returns, given its shares, on the cluster as given."""
    prof, c = _search_case(n, per_server, slow, bw, act, gbs)
    c = _own_profiles(c, prof, factors[:n])
    plan = dapple_search(fastest_layers(prof, c), search_cluster(c), gbs)
    priced = with_kind_shares(plan, prof, c)
    L = pipeline_latency(priced, prof, c).L_ms
    assert plan.predicted_step_ms == pytest.approx(L, rel=1e-9)
    assert dataclasses.replace(priced, predicted_step_ms=0.0).stages == priced.stages


def test_a_tie_between_kinds_breaks_alike_in_the_search_and_the_cost_model() -> None:
    """Layer 1 takes the same time on both kinds, but the scorer's prefix sums give the slow
    kind's (its layer 0 is 1.7x) 1.2999999999999998 ms where the cost model sums 1.3: the
    shares of layer 1 over one fast and two slow devices must still tie alike (even: 3, 3, 2),
    else the split-concat is priced on other shares (53.64 against 52.04 ms)."""
    from dapple.cost.replica_shares import balanced_shares_of

    slower, faster = (lambda n: 1.3 * n), (lambda n: 1.2999999999999998 * n)
    assert balanced_shares_of(8, [slower, faster, faster]) == (3, 3, 2)
    prof = make_profile(2, fwd=1.3, bwd=2.7, act=1e5)
    c = _own_profiles(_cluster(2, 0.23, 100.0, 1.0), prof, [1.7, 1.0])
    sc = Scorer(prof, c, 8)
    assert kind_shares(sc, 1, 2, (1, 2, 3), 8) is None
    both = _cost_model_ms(sc, [(0, 1, (0,)), (1, 2, (1, 2, 3))], 1)
    assert both is not None
    assert both[0] == pytest.approx(both[1], rel=1e-12)
