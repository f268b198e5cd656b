"""The communication-overlap model (dapple.cost.overlap): hand-computed passes, the closed form,
bounds and monotonicity, and dapple's own plans costing what they cost without it."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.parallelism import Parallelism
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.cost.overlap import (
    FRAMEWORKS,
    NO_OVERLAP,
    equal_chunks_exposed_ms,
    exposed_fsdp_pass_ms,
    exposed_sync_ms,
    layered_pass_exposed_ms,
    split_by_bytes,
)
from dapple.cost.terms import stage_terms
from dapple.errors import ValidationError
from dapple.simulate.engine import simulate

MEGATRON, FSDP2 = FRAMEWORKS["megatron"], FRAMEWORKS["fsdp2"]


# -- one pass, by hand -----------------------------------------------------------------------


def test_gathers_one_layer_ahead_by_hand() -> None:
    # G0 [0,3]; L0 [3,5]; G1 [3,6]; L1 [6,8]; G2 [6,9]; L2 [9,11]: 11 - 6 of compute
    assert layered_pass_exposed_ms([2, 2, 2], gather=[3, 3, 3]) == pytest.approx(5.0)


def test_reduces_follow_their_layer_by_hand() -> None:
    # L0 [0,4]; R0 [4,5]; L1 [4,5]; R1 [5,8]: 8 - 5 of compute
    assert layered_pass_exposed_ms([4, 1], reduce=[1, 3]) == pytest.approx(3.0)


def test_gathers_and_reduces_share_one_link_by_hand() -> None:
    # G0 [0,1]; L0 [1,3]; G1 [1,2]; R0 [3,4]; L1 [3,5]; R1 [5,6]: 6 - 4 of compute
    assert layered_pass_exposed_ms([2, 2], gather=[1, 1], reduce=[1, 1]) == pytest.approx(2.0)


def test_a_gather_waits_for_the_layer_two_before() -> None:
    # G2 may not start before L0 ends (5): one layer ahead, not two; ends at 6
    assert layered_pass_exposed_ms([5, 0, 0], gather=[0, 1, 1]) == pytest.approx(1.0)


def test_no_traffic_is_nothing_exposed() -> None:
    assert layered_pass_exposed_ms([1.0, 2.0]) == 0.0
    assert layered_pass_exposed_ms([]) == 0.0


def test_closed_form_by_hand() -> None:
    assert equal_chunks_exposed_ms(9.0, 6.0, 3) == pytest.approx(5.0)  # 3 + 2/3 x 3
    assert equal_chunks_exposed_ms(2.0, 10.0, 4) == pytest.approx(0.5)  # one chunk
    assert equal_chunks_exposed_ms(2.0, 10.0, 1) == pytest.approx(2.0)  # nothing to hide under


def test_bad_inputs_are_refused_in_one_line() -> None:
    with pytest.raises(ValidationError, match="one time per layer"):
        layered_pass_exposed_ms([1.0, 1.0], gather=[1.0])
    with pytest.raises(ValidationError, match=">= 0"):
        layered_pass_exposed_ms([1.0], reduce=[-1.0])
    with pytest.raises(ValidationError, match="chunks >= 1"):
        equal_chunks_exposed_ms(1.0, 1.0, 0)


def test_split_by_bytes() -> None:
    assert split_by_bytes(6.0, [1, 2, 3]) == pytest.approx([1.0, 2.0, 3.0])
    assert split_by_bytes(6.0, [0, 0]) == [6.0, 0.0]


def _zero(stage: int) -> Parallelism:
    """Two replicas at ZeRO ``stage``."""
    return Parallelism(replicas=2, zero_stage=stage)


# -- a stage's synchronisation, by hand ------------------------------------------------------


def test_allreduce_under_the_last_backward_by_hand() -> None:
    # reversed backward [3, 3], AR 4 in chunks [2, 2]: R [3,5], R [6,8]: 2 exposed
    assert exposed_sync_ms(MEGATRON, 4.0, _zero(0), 8, [1, 1], [3, 3], [1, 1]) == pytest.approx(2.0)
    assert exposed_sync_ms(NO_OVERLAP, 4.0, _zero(0), 8, [1, 1], [3, 3], [1, 1]) == 4.0


def test_distributed_optimizer_hides_both_halves_by_hand() -> None:
    # RS 2 under backward [3, 3]: 1 exposed; AG 2 under forward [1, 1]: G [0,1] L [1,2]
    # G [1,2] L [2,3]: 1 exposed
    assert exposed_sync_ms(MEGATRON, 4.0, _zero(1), 8, [1, 1], [3, 3], [1, 1]) == pytest.approx(2.0)


def test_fsdp_pass_by_hand() -> None:
    # forward: G 1+1 under [1, 1] -> 1; backward [2, 2] with G [1,1] and R [1,1] -> 2 (above)
    f, b = exposed_fsdp_pass_ms(FSDP2, 2.0, 2.0, [1, 1], [2, 2], [1, 1])
    assert (f, b) == pytest.approx((1.0, 2.0))
    assert exposed_fsdp_pass_ms(NO_OVERLAP, 2.0, 2.0, [1, 1], [2, 2], [1, 1]) == (2.0, 4.0)


# -- properties ------------------------------------------------------------------------------

_times = st.floats(0.0, 100.0, allow_nan=False, allow_infinity=False)


@st.composite
def _passes(draw):  # type: ignore[no-untyped-def]
    k = draw(st.integers(1, 8))
    lists = st.lists(_times, min_size=k, max_size=k)
    return draw(lists), draw(lists), draw(lists), draw(st.integers(0, k - 1)), draw(_times)


@settings(max_examples=300, deadline=None)
@given(_passes())
def test_exposed_is_bounded_and_falls_as_compute_grows(case) -> None:  # type: ignore[no-untyped-def]
    compute, gather, reduce, i, more = case
    got = layered_pass_exposed_ms(compute, gather, reduce)
    assert -1e-9 <= got <= sum(gather) + sum(reduce) + 1e-9
    slower = list(compute)
    slower[i] += more
    assert layered_pass_exposed_ms(slower, gather, reduce) <= got + 1e-9


@settings(max_examples=200, deadline=None)
@given(_times, _times, st.integers(1, 64), _times)
def test_closed_form_matches_the_pass_and_is_bounded(comm, compute, k, more) -> None:  # type: ignore[no-untyped-def]
    got = equal_chunks_exposed_ms(comm, compute, k)
    assert 0.0 <= got <= comm + 1e-9
    assert equal_chunks_exposed_ms(comm, compute + more, k) <= got + 1e-9
    chunks = ([compute / k] * k, [comm / k] * k)
    assert layered_pass_exposed_ms(chunks[0], gather=chunks[1]) == pytest.approx(got, abs=1e-6)
    assert layered_pass_exposed_ms(chunks[0], reduce=chunks[1]) == pytest.approx(got, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(_passes(), _times, st.integers(0, 3), st.integers(1, 16))
@example(([0.0], [0.0], [5e-324], 0, 0.0), 1.5, 0, 1)  # a denormal byte count: its share is 1
def test_a_stage_sync_stays_between_zero_and_all_of_it(case, sync, zero, M) -> None:  # type: ignore[no-untyped-def]
    compute, _, nbytes, _, _ = case
    for overlap in FRAMEWORKS.values():
        got = exposed_sync_ms(overlap, sync, _zero(zero), M, compute, compute, nbytes)
        assert -1e-9 <= got <= sync + 1e-9


# -- in the cost model and the simulator ------------------------------------------------------


def _profile(n: int = 6) -> ModelProfile:
    layer = LayerProfile(
        name="block",
        forward=AffineTime(fixed_ms=0.5, per_sample_ms=2.0),
        backward=AffineTime(fixed_ms=1.0, per_sample_ms=4.0),
        parameter_bytes=200_000_000,
        output_bytes_per_sample=1_000_000,
        kept_activation_bytes_per_sample=4_000_000,
    )
    return ModelProfile(model_name="toy", layers=tuple(layer for _ in range(n)))


def _cluster() -> Cluster:
    return Cluster(
        name="toy", servers=2, devices_per_server=2, device_memory_bytes=80 * 2**30,
        intra_server_bandwidth_gbps=800, inter_server_bandwidth_gbps=100,
    )  # fmt: skip


def _plan(zero: int, regather: bool, M: int = 2) -> Plan:
    stage = StagePlan(layers=(0, 6), devices=(0, 1, 2, 3), zero_stage=zero, regather=regather)
    return Plan(planner="test", global_batch_size=8 * M, micro_batch_size=8,
                num_micro_batches=M, stages=(stage,), schedule="dapple", model_name="toy")  # fmt: skip


@pytest.mark.parametrize(("zero", "regather"), [(0, False), (1, False), (3, False), (3, True)])
def test_overlap_lies_between_no_overlap_and_free_links(zero: int, regather: bool) -> None:
    prof, cluster = _profile(), _cluster()
    free = Cluster(
        name="free", servers=2, devices_per_server=2, device_memory_bytes=80 * 2**30,
        intra_server_bandwidth_gbps=1e15, inter_server_bandwidth_gbps=1e15,
        intra_server_latency_ms=0.0, inter_server_latency_ms=0.0,
    )  # fmt: skip
    plan = _plan(zero, regather)
    none = simulate(plan, prof, cluster).step_ms
    assert simulate(plan, prof, cluster, overlap=NO_OVERLAP).step_ms == none
    lo = simulate(plan, prof, free).step_ms
    for overlap in (MEGATRON, FSDP2):
        got = simulate(plan, prof, cluster, overlap=overlap).step_ms
        assert lo - 1e-9 <= got < none


def test_dapple_runtime_terms_are_the_default() -> None:
    prof, cluster = _profile(), _cluster()
    for plan in (_plan(0, False), _plan(3, True)):
        assert stage_terms(plan, prof, cluster) == stage_terms(
            plan, prof, cluster, overlap=NO_OVERLAP
        )
