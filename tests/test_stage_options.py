"""A stage's options costed per zero mode when first read (:mod:`dapple.planner.stage_options`),
the scorer's shared sync plans, and the first free devices of an occupancy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import llm_layer, make_cluster
from dapple.core.profile import ModelProfile
from dapple.cost.tensor import fsdp_pass_ms, replica_sync_ms
from dapple.planner.placement import first_free_devices, remaining_devices
from dapple.planner.scorer import Scorer
from dapple.planner.stage_options import LazyOptions, StageOption
from dapple.planner.zero_modes import UNSHARDED, ZeroMode


def _option(x: float) -> StageOption:
    none: object = None  # the stage terms: not read here
    return StageOption(x, x, x, 1, 1, none, none)  # type: ignore[arg-type]


def test_lazy_options_cost_each_mode_once_when_first_read() -> None:
    modes = (UNSHARDED, ZeroMode(1), ZeroMode(2))
    costed: list[ZeroMode] = []

    def make(mode: ZeroMode) -> StageOption:
        costed.append(mode)
        return _option(float(mode.stage))

    got = LazyOptions(modes, make)
    assert len(got) == 3 and bool(got) and costed == []
    assert got[0] == (UNSHARDED, _option(0.0)) and costed == [UNSHARDED]
    assert got[-1] == (ZeroMode(2), _option(2.0)) and costed == [UNSHARDED, ZeroMode(2)]
    assert [m for m, _ in got] == list(modes)  # the middle one costed, the others kept
    assert costed == [UNSHARDED, ZeroMode(2), ZeroMode(1)]
    assert got[1:] == [(ZeroMode(1), _option(1.0)), (ZeroMode(2), _option(2.0))]
    assert len(costed) == 3
    with pytest.raises(IndexError):
        got[3]
    assert not LazyOptions((), make)


def _profile() -> ModelProfile:
    """Four shardable blocks of 1.5 GiB of parameters: memory asks for ZeRO on 16 GiB devices
    where a stage holds more than one."""
    return ModelProfile(
        model_name="lazy", layers=tuple(llm_layer(f"b{i}", True, 1.5) for i in range(4))
    )


@pytest.mark.parametrize("t", [1, 2])
def test_options_read_lazily_equal_every_mode_costed_at_once(t: int) -> None:
    sc = Scorer(_profile(), make_cluster(2, 4), 16, "auto", t)
    for s, e, d, b in [
        (0, 2, (0, 1), 4),
        (1, 4, (0, 1, 2), 8),
        (0, 4, (1,), 2),
        (2, 3, (2, 3), 16),
    ]:
        if len(d) * t > sc.real_cluster.num_devices:
            continue
        got = sc.stage_options(s, e, d, b)
        modes = sc._modes(s, e, len(d))
        assert len(got) == len(modes) > 0
        assert list(got) == [(m, sc._stage(s, e, d, b, m)) for m in modes]


def test_a_stage_holding_its_micro_batches_unsharded_costs_no_other_mode() -> None:
    sc = Scorer(_profile(), make_cluster(2, 4, gbps=100.0), 64, "auto", 1)
    stages = [(0, 1, (0, 1)), (1, 2, (2, 3)), (2, 3, (4, 5)), (3, 4, (6, 7))]
    assert sc.score(stages, 64) is not None  # b = 1: every stage holds its K_i unsharded
    for s, e, d in stages:
        options = sc.stage_options(s, e, d, 1)
        assert isinstance(options, LazyOptions) and len(options) > 1
        assert options._got[0] is not None and options._got[1:] == [None] * (len(options) - 1)


@pytest.mark.parametrize("t", [1, 2])
def test_sync_terms_of_every_mode_are_those_of_its_own_stage_plan(t: int) -> None:
    sc = Scorer(_profile(), make_cluster(4, 4), 16, "auto", t)
    d = (0, 1, 2) if t == 2 else (0, 1, 5, 6, 9)
    for mode in sc._modes(0, 4, len(d)):
        own = sc.stage_plan(0, 1, d, mode)  # the plan of this very mode
        nbytes = sc.param_bytes(0, 4)
        want = replica_sync_ms(sc.real_cluster, nbytes, own, own.parallel, 4)
        assert sc.ar_ms(0, 4, d, mode, 4) == want, mode
        shared = sc._sync_plan(d, mode)
        assert fsdp_pass_ms(sc.real_cluster, nbytes, shared) == fsdp_pass_ms(
            sc.real_cluster, nbytes, own
        )
    assert len(sc._sync_plans) <= 2  # once per step, and re-gathering


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]).flatmap(
        lambda dps: st.tuples(
            st.just(dps),
            st.lists(st.integers(0, dps), min_size=1, max_size=6),
            st.integers(0, 50),
        )
    )
)
def test_first_free_devices_are_the_first_of_all_free_ones(
    case: tuple[int, list[int], int],
) -> None:
    dps, occ, n = case
    cluster = make_cluster(len(occ), dps)
    free = remaining_devices(cluster, tuple(occ))
    assert first_free_devices(cluster, tuple(occ), n) == free[:n]
