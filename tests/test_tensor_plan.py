"""Tensor-parallel width and ZeRO-3 in plans, the cost model, the simulator and the planner.

Golden numbers are computed by hand below each test; formulas in :mod:`dapple.cost.tensor`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_cluster, make_profile
from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.parallelism import Parallelism
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import check_tensor_groups
from dapple.cost.memory import (
    gradients_in_flight_bytes,
    parameter_state_bytes,
    state_bytes_per_parameter_byte,
)
from dapple.cost.schedule_step import schedule_latency
from dapple.cost.terms import stage_terms
from dapple.errors import ValidationError
from dapple.planner.scorer import Scorer
from dapple.planner.search import dapple_search
from dapple.simulate.engine import simulate

GBPS = 8.0  # 8 Gbit/s = 1e6 bytes per ms: bytes / 1e6 = ms
LAT = 0.01


def _cluster(servers: int = 1, per_server: int = 8, inter_gbps: float = GBPS) -> Cluster:
    return Cluster(
        name="tp-test",
        servers=servers,
        devices_per_server=per_server,
        device_memory_bytes=16 * 1024**3,
        intra_server_bandwidth_gbps=GBPS,
        inter_server_bandwidth_gbps=inter_gbps,
        intra_server_latency_ms=LAT,
        inter_server_latency_ms=LAT,
    )


def _blocks(n: int = 2, tp: bool = True) -> ModelProfile:
    """n blocks: F = 4 ms, B = 8 ms per sample, output 1e6 B, kept 1e7 B, 8e6 parameter B."""
    return ModelProfile(
        model_name="blocks",
        layers=tuple(
            LayerProfile(
                name=f"b{i}",
                forward=AffineTime(fixed_ms=0.0, per_sample_ms=4.0),
                backward=AffineTime(fixed_ms=0.0, per_sample_ms=8.0),
                output_bytes_per_sample=1e6,
                parameter_bytes=8_000_000,
                kept_activation_bytes_per_sample=1e7,
                tensor_parallel=tp,
            )
            for i in range(n)
        ),
    )


def _plan(t: int, replicas: int = 1, zero: int = 0, regather: bool = False, M: int = 2) -> Plan:
    return Plan(
        planner="manual",
        global_batch_size=2 * M,
        micro_batch_size=2,
        num_micro_batches=M,
        stages=(
            StagePlan(
                layers=(0, 2),
                devices=tuple(range(replicas * t)),
                tensor_width=t,
                zero_stage=zero,
                regather=regather,
            ),
        ),
    )


# -- plan format -----------------------------------------------------------------------------


def test_json_round_trip_with_width_and_zero3() -> None:
    plan = _plan(2, replicas=2, zero=3, regather=True)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["stages"][0]["tensor_width"] == 2 and d["stages"][0]["regather"] is True
    assert Plan.from_dict(d) == plan
    st0 = plan.stages[0]
    assert st0.replicas == 2 and st0.replica_devices == (0, 2)
    assert st0.tensor_group(1) == (2, 3) and st0.replica_group(1) == (1, 3)
    assert plan.stage_of_device(3) == (0, 1) and plan.replica_devices == (0, 2)


def test_width_one_leaves_the_json_unchanged() -> None:
    d = _plan(1, replicas=2).to_dict()
    assert "tensor_width" not in d["stages"][0] and "regather" not in d["stages"][0]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            {"devices": (0, 1, 2), "tensor_width": 3},
            r"tensor_width must be a power of two >= 1, got 3",
        ),
        (
            {"devices": (0, 1, 2), "tensor_width": 2},
            r"3 devices \[0, 1, 2\] are not whole tensor groups of tensor_width=2",
        ),
        ({"devices": (0, 1), "tensor_width": 2, "zero_stage": 3}, r"zero_stage 3 .* one replica"),
        (
            {"devices": (0, 1), "zero_stage": 2, "regather": True},
            r"regather applies to zero_stage 3 only, got zero_stage 2",
        ),
    ],
)
def test_bad_stage_layouts_name_their_values(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        StagePlan(layers=(0, 2), **kw)  # type: ignore[arg-type]


def test_a_tensor_group_across_servers_is_refused_before_any_compute() -> None:
    plan = Plan(
        planner="manual",
        global_batch_size=2,
        micro_batch_size=2,
        num_micro_batches=1,
        stages=(StagePlan(layers=(0, 2), devices=(3, 4), tensor_width=2),),
    )
    cluster = _cluster(servers=2, per_server=4)
    with pytest.raises(
        ValidationError, match=r"tensor group 0 on devices \[3, 4\] spans servers \[0, 1\]"
    ):
        check_tensor_groups(plan, cluster)
    with pytest.raises(ValidationError, match="spans servers"):
        stage_terms(plan, _blocks(), cluster)
    with pytest.raises(ValidationError, match=r"tensor_width=8 is wider than a server"):
        check_tensor_groups(_plan(8), _cluster(servers=2, per_server=4))


# -- cost model: golden numbers by hand ------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 4])
def test_golden_compute_and_collectives(t: int) -> None:
    """Two blocks, b = 2 samples, one replica: F = 2 x 4 ms x 2 / t + 2 blocks x 2 all-reduces
    of 2e6 B; a ring all-reduce on t: 2(t-1)/t x 2e6 / 1e6 ms + 2(t-1) x 0.01 ms."""
    terms = stage_terms(_plan(t), _blocks(), _cluster())
    ar = 0.0 if t == 1 else 2 * (t - 1) / t * 2.0 + 2 * (t - 1) * LAT
    assert terms.stages[0].terms.forward_ms == pytest.approx(16.0 / t + 4 * ar)
    assert terms.stages[0].terms.backward_ms == pytest.approx(32.0 / t + 4 * ar)
    golden = {
        1: (16.0, 32.0),
        2: (8.0 + 4 * 2.02, 16.0 + 4 * 2.02),
        4: (4.0 + 4 * 3.06, 8.0 + 4 * 3.06),
    }
    assert terms.stages[0].terms.forward_ms == pytest.approx(golden[t][0])
    assert terms.stages[0].terms.backward_ms == pytest.approx(golden[t][1])
    r = terms.stages[0].replicas[0]
    assert r.input_grad_ms + r.weight_grad_ms == pytest.approx(r.backward_ms)  # first stage: all W


@pytest.mark.parametrize("t", [1, 2, 4])
def test_golden_memory(t: int) -> None:
    """Parameters 2 x 8e6 / t with 4 x (fp32 Adam: 1 + 3) plus the largest layer's gradient in
    flight 8e6 / t; kept activations per sample 5e6 whole + 5e6 / t per block (Korthikanti).
    The loss (one stage is the last): 2 x 2.5e5 fp32 logits, its log-softmax 2e6 B kept and
    4e6 B of gradients in its backward. One stage, M = 2, K = 1: the peak is the second
    backward. At t = 1 the gradients are set to None each step, so the static bytes leave them
    out; they exist in the second backward (16e6) with the last block's 8e6 in flight, its
    output's gradient 2e6 and both blocks' kept bytes (4e7; the log-softmax is freed by then).
    On tensor ranks they stay (in the state), and the loss's moment is the largest."""
    prof = _blocks()
    state = parameter_state_bytes(prof, (0, 2), Parallelism(tensor_width=t))
    assert state == pytest.approx(16e6 / t * 4 + 8e6 / t)
    sim = simulate(_plan(t), prof, _cluster())
    held = 2 * (5e6 + 5e6 / t) * 2  # 2 blocks x kept x 2 samples
    if t == 1:
        static = state - 16e6 - 8e6
        peak = static + 16e6 + 8e6 + 2e6 + held
    else:
        static, peak = state, state + held + 2e6 + 4e6
    assert sim.devices[0].static_memory_bytes == pytest.approx(static)
    assert sim.devices[0].peak_memory_bytes == pytest.approx(peak)


def test_replica_allreduce_moves_the_tensor_shards() -> None:
    """2 replicas x t = 2 in one server: AR of 16e6 / 2 B over 2 devices: 8 ms + 0.02 ms."""
    terms = stage_terms(_plan(2, replicas=2), _blocks(), _cluster())
    assert terms.stages[0].terms.sync_ms == pytest.approx(2 * 1 / 2 * 8.0 + 2 * LAT)


def test_zero3_gathers_once_per_step_or_per_micro_batch() -> None:
    cluster, prof = _cluster(), _blocks()
    ar = stage_terms(_plan(1, replicas=2), prof, cluster).stages[0].terms
    once = stage_terms(_plan(1, replicas=2, zero=3), prof, cluster).stages[0].terms
    again = stage_terms(_plan(1, replicas=2, zero=3, regather=True), prof, cluster).stages[0].terms
    assert once.sync_ms == pytest.approx(ar.sync_ms)  # all-gather + reduce-scatter = AR
    assert again.sync_ms == 0.0
    assert again.forward_ms == pytest.approx(ar.forward_ms + ar.sync_ms / 2)
    assert again.backward_ms == pytest.approx(ar.backward_ms + ar.sync_ms)
    # memory: (1 + 3) / r sharded; without regather the whole parameters and gradients, the
    # parameter shard and the moments' shards (3 - 1) / r: the gradient shard exists only from
    # the step's reduce-scatter on, whose flat input takes the re-sharded parameters' place and
    # whose output (P / r) is in flight then
    assert state_bytes_per_parameter_byte(prof, _zero3(regather=True)) == pytest.approx(2.0)
    assert state_bytes_per_parameter_byte(prof, _zero3()) == pytest.approx(2 + 3 / 2)
    P = prof.parameter_bytes  # 2 blocks x 8e6
    assert gradients_in_flight_bytes(prof, (0, 2), _zero3()) == pytest.approx(P / 2)
    # regather: one block computing, 2 gathered (prefetch), one block's reduce-scatter buffers
    assert gradients_in_flight_bytes(prof, (0, 2), _zero3(regather=True)) == pytest.approx(
        (1 + 2 + 1.5) * 8e6
    )


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 6),
    reps=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    zero=st.integers(0, 2),
    recompute=st.booleans(),
)
def test_width_one_is_todays_cost(n: int, reps: list[int], zero: int, recompute: bool) -> None:
    """t = 1 through the new fields equals the plan without them, and the flag changes nothing."""
    bounds = [round(i * n / len(reps)) for i in range(len(reps))]
    if len(set(bounds)) < len(bounds):
        return
    prof = make_profile(n)
    flagged = dataclasses.replace(
        prof, layers=tuple(dataclasses.replace(x, tensor_parallel=True) for x in prof.layers)
    )
    cluster = make_cluster(servers=2, per_server=4)
    from dapple.core.plan import straight_plan

    plan = straight_plan(n, bounds, global_batch_size=8, num_micro_batches=2, replicas=reps)
    plan = dataclasses.replace(
        plan,
        stages=tuple(
            dataclasses.replace(
                s,
                zero_stage=zero if s.replicas > 1 else 0,
                recompute="full" if recompute else "none",
            )
            for s in plan.stages
        ),
    )
    a = stage_terms(plan, prof, cluster)
    b = stage_terms(plan, flagged, cluster)
    assert [s.terms for s in a.stages] == [s.terms for s in b.stages]
    assert schedule_latency(plan, prof, cluster) == schedule_latency(plan, flagged, cluster)


def test_the_scorer_costs_a_tp_plan_as_the_cost_model() -> None:
    prof, cluster = _blocks(4), _cluster(servers=2, per_server=4)
    sc = Scorer(prof, cluster, 8, tensor_width=2)
    stages = [(0, 2, (0, 1)), (2, 4, (2, 3))]  # tensor groups of 2
    got = sc.score(stages, 4)
    assert got is not None
    plan = sc.build_plan("dapple", stages, 4, got)
    assert plan.stages[1].devices == (4, 5, 6, 7) and plan.stages[1].tensor_width == 2
    assert schedule_latency(plan, prof, cluster) == pytest.approx(got.L_ms)
    sim = simulate(plan, prof, cluster)
    assert sim.step_ms == pytest.approx(got.L_ms, rel=0.05)


# -- planner ---------------------------------------------------------------------------------


def _zero3(regather: bool = False) -> Parallelism:
    """Two replicas under ZeRO-3."""
    return Parallelism(replicas=2, zero_stage=3, regather=regather)


def _big_blocks(n: int = 8, layer_gib: float = 6.0) -> ModelProfile:
    """Transformer-like blocks whose parameter state (16 B per 4 B parameter) does not fit a
    16 GiB device unless sharded: each layer holds ``layer_gib`` GiB of parameters."""
    pb = int(layer_gib * 2**30)
    return ModelProfile(
        model_name="big",
        layers=tuple(
            LayerProfile(
                name=f"b{i}",
                forward=AffineTime(fixed_ms=0.1, per_sample_ms=10.0),
                backward=AffineTime(fixed_ms=0.2, per_sample_ms=20.0),
                output_bytes_per_sample=1e5,
                parameter_bytes=pb,
                kept_activation_bytes_per_sample=1e6,
                tensor_parallel=True,
            )
            for i in range(n)
        ),
    )


@pytest.mark.timeout(900)  # ~150 CPU-s of search (16 devices, every width): slow under CI load
def test_the_planner_shards_a_model_that_fits_no_device_whole() -> None:
    """One 6 GiB layer takes 6 x 4 + 6 = 30 GiB > 16 GiB: only t >= 2 fits (ZeRO aside)."""
    prof, cluster = _big_blocks(), _cluster(servers=2, per_server=8)
    with pytest.raises(Exception, match="no plan"):
        dapple_search(prof, cluster, 16, tensor_widths=[1])
    plan = dapple_search(prof, cluster, 16)
    assert all(s.tensor_width >= 2 for s in plan.stages)
    check_tensor_groups(plan, cluster)
    assert schedule_latency(plan, prof, cluster) == pytest.approx(plan.predicted_step_ms)


def test_tp_loses_to_replication_on_slow_links() -> None:
    """Tiny activations, high link latency: 4 all-reduces per block cost more than t saves."""
    prof = _blocks(4)
    slow = dataclasses.replace(_cluster(), intra_server_latency_ms=50.0)
    plan = dapple_search(prof, slow, 16)
    assert all(s.tensor_width == 1 for s in plan.stages)
    fast = dataclasses.replace(
        _cluster(), intra_server_bandwidth_gbps=8e6, intra_server_latency_ms=0.0
    )
    assert any(s.tensor_width > 1 for s in dapple_search(prof, fast, 2).stages)


def test_a_profile_without_shardable_layers_plans_as_today() -> None:
    prof, cluster = _blocks(4, tp=False), _cluster()
    assert dapple_search(prof, cluster, 16) == dapple_search(prof, cluster, 16, tensor_widths=[1])


@pytest.mark.parametrize("per_server", [2, 4, 8])
def test_the_planner_never_places_a_tensor_group_across_servers(per_server: int) -> None:
    prof = _big_blocks(6, layer_gib=1.0)
    cluster = _cluster(servers=3, per_server=per_server, inter_gbps=1.0)
    for t in (2, 4, 8):
        if per_server % t:
            continue
        plan = dapple_search(prof, cluster, 12, tensor_widths=[t])
        check_tensor_groups(plan, cluster)
        for s in plan.stages:
            for j in range(s.replicas):
                assert len({cluster.server_of(d) for d in s.tensor_group(j)}) == 1
