"""The optimizer update U_s in the cost model: measured by the profiler, stored in the profile,
added to AR_s by the planner (1/r_s of it under ZeRO), run as the OPT action's time by the
simulator, and left out where the calibrated host CPU already holds it."""

from __future__ import annotations

import dataclasses

import pytest

from builders import make_cluster, make_profile
from dapple.core.parallelism import Parallelism
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.comm import stage_sync_ms, stage_update_ms
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.schedule.ir import ActionKind
from dapple.simulate import simulate

U = 1e-6  # ms per parameter byte
PARAMS = 4 * 10**6  # bytes per layer


def _profile(u: float = U) -> ModelProfile:
    return dataclasses.replace(make_profile(params=PARAMS), update_ms_per_parameter_byte=u)


def test_profile_json_round_trips_u_and_old_profiles_have_none() -> None:
    prof = _profile()
    d = prof.to_dict()
    assert d["update_ms_per_parameter_byte"] == U
    assert ModelProfile.from_dict(d) == prof
    del d["update_ms_per_parameter_byte"]
    assert ModelProfile.from_dict(d).update_ms_per_parameter_byte == 0.0
    assert "update_ms_per_parameter_byte" not in _profile(0.0).to_dict()
    with pytest.raises(ValidationError, match="update_ms_per_parameter_byte must be a finite"):
        ModelProfile.from_dict({**d, "update_ms_per_parameter_byte": -1})


def test_stage_update_is_u_times_bytes_over_the_shards() -> None:
    cl, prof = make_cluster(), _profile()
    three, four = Parallelism(replicas=3), Parallelism(replicas=4, zero_stage=1)
    assert stage_update_ms(cl, prof, 8e6, three) == pytest.approx(8.0)
    assert stage_update_ms(cl, prof, 8e6, four) == pytest.approx(2.0)  # ZeRO: 1/r_s each
    one = Parallelism(replicas=1, zero_stage=2)  # one replica: no shards
    assert stage_update_ms(cl, prof, 8e6, one) == pytest.approx(8.0)
    assert stage_update_ms(cl, _profile(0.0), 8e6, three) == 0.0
    host = dataclasses.replace(cl, step_overhead_ms=3.0)  # calibrated host CPU holds it
    assert stage_update_ms(host, prof, 8e6, three) == 0.0


def test_planner_adds_u_to_ar_and_the_simulator_runs_it_as_opt() -> None:
    cl = make_cluster()
    plan = straight_plan(6, [0, 3], global_batch_size=12, num_micro_batches=4, replicas=[1, 3])
    with_u, without = _profile(), _profile(0.0)
    rows = {
        u: [r for r in pipeline_latency(plan, p, cl).stages if r.kind == "compute"]
        for u, p in ((True, with_u), (False, without))
    }
    for s, (lo, hi) in enumerate(st.layers for st in plan.stages):
        update = U * PARAMS * (hi - lo)
        assert rows[True][s].allreduce_ms == pytest.approx(rows[False][s].allreduce_ms + update)
    assert rows[False][1].allreduce_ms == pytest.approx(
        stage_sync_ms(cl, 3 * PARAMS, plan.stages[1].devices)
    )
    sim = simulate(plan, with_u, cl)
    opt = {e.device: e.duration_ms for e in sim.events if e.action.kind is ActionKind.STEP}
    assert opt == pytest.approx({0: U * 3 * PARAMS, 1: U * 3 * PARAMS, 2: U * 3 * PARAMS,
                                 3: U * 3 * PARAMS})  # fmt: skip
    base = simulate(plan, without, cl)
    assert sim.step_ms > base.step_ms
    # ZeRO-1 on the replicated stage: each replica updates a third
    z1 = dataclasses.replace(
        plan, stages=(plan.stages[0], dataclasses.replace(plan.stages[1], zero_stage=1))
    )
    opt1 = {e.device: e.duration_ms for e in simulate(z1, with_u, cl).events
            if e.action.kind is ActionKind.STEP}  # fmt: skip
    assert opt1[0] == pytest.approx(U * 3 * PARAMS) and opt1[1] == pytest.approx(U * PARAMS)


def test_profiler_measures_the_update() -> None:
    pytest.importorskip("torch")
    from dapple.models.zoo import load_workload
    from dapple.profiler.measure import profile_workload

    wl = load_workload("mlp", layers=2, in_features=8, hidden=64, num_classes=4)
    prof = profile_workload(wl, [1, 2], device="cpu", repeats=2, warmup=1)
    assert 0 < prof.update_ms_per_parameter_byte < float("inf")


def test_update_is_timed_on_a_bounded_sample_and_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer larger than the sample is timed on a prefix of its parameters (the last one cut
    flat) and the time scaled by its bytes over the sample's."""
    torch = pytest.importorskip("torch")
    import dapple.profiler.layer_measure as measure

    monkeypatch.setattr(measure, "_UPDATE_SAMPLE_BYTES", 1000)
    steps: list[list[int]] = []

    def timer(fn):  # type: ignore[no-untyped-def]
        fn()
        return 2.0, None

    real_adam = torch.optim.Adam

    def spy(params, **kw):  # type: ignore[no-untyped-def]
        params = list(params)
        steps.append([p.numel() for p in params])
        return real_adam(params, **kw)

    monkeypatch.setattr(torch.optim, "Adam", spy)
    layer = torch.nn.Linear(30, 20)  # 600 + 20 floats: 2480 bytes
    ms = measure.optimizer_update_ms(
        measure.trainable_params(layer), torch.device("cpu"), timer, 1, 3
    )
    assert steps == [[250]]  # 1000 bytes: the weight's first 250 elements
    assert ms == pytest.approx(2.0 * 2480 / 1000)
    small = torch.nn.Linear(3, 2)  # 8 floats: the whole layer, shapes kept
    assert (
        measure.optimizer_update_ms(
            measure.trainable_params(small), torch.device("cpu"), timer, 1, 3
        )
        == 2.0
    )
    assert steps[-1] == [6, 2]
