"""The step-peak memory model read three ways agrees with itself.

:func:`dapple.cost.peak_memory.stage_peak` is a closed form over phases; the planner's
:func:`~dapple.cost.peak_memory.in_flight_limit` inverts it for D; the schedule-wide replay
(:func:`~dapple.cost.peak_memory.device_peak`, :func:`dapple.cost.schedule_step.device_memory_by_group`)
and the simulator walk a device's compute order action by action. Properties against brute force
over random chains, plans and schedules.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.peak_memory import in_flight_limit, plan_stage_bytes, stage_peak
from dapple.cost.pipeline import in_flight_bounds, pipeline_latency
from dapple.cost.schedule_step import device_memory_by_group
from dapple.simulate import simulate

FAST = settings(max_examples=60, deadline=None)

_layer = st.tuples(
    st.integers(0, 4000),  # parameter bytes
    st.integers(0, 3000),  # kept bytes per sample
    st.integers(0, 2000),  # output bytes per sample
)


def _profile(layers: list[tuple[int, int, int]], precision: str = "fp32") -> ModelProfile:
    return ModelProfile(
        model_name="chain",
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=0.0, per_sample_ms=1.0),
                backward=AffineTime(fixed_ms=0.0, per_sample_ms=2.0),
                output_bytes_per_sample=float(out),
                parameter_bytes=params,
                kept_activation_bytes_per_sample=float(kept),
            )
            for i, (params, kept, out) in enumerate(layers)
        ),
        input_bytes_per_sample=8.0,
        precision=precision,
    )


@st.composite
def _plans(draw: st.DrawFn):
    layers = draw(st.lists(_layer, min_size=2, max_size=6))
    n = len(layers)
    S = draw(st.integers(1, min(3, n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=S - 1, max_size=S - 1)))
    reps = draw(st.lists(st.integers(1, 2), min_size=S, max_size=S))
    M = draw(st.integers(1, 6))
    b = draw(st.integers(1, 4))
    plan = straight_plan(
        n,
        [0, *cuts],
        global_batch_size=M * b,
        num_micro_batches=M,
        replicas=reps,
        schedule=draw(st.sampled_from(["dapple", "gpipe"])),
    )
    recompute = draw(st.lists(st.booleans(), min_size=S, max_size=S))
    zero = draw(st.lists(st.sampled_from([0, 1, 2]), min_size=S, max_size=S))
    stages = tuple(
        dataclasses.replace(
            s, recompute="full" if r else "none", zero_stage=z if s.replicas > 1 else 0
        )
        for s, r, z in zip(plan.stages, recompute, zero, strict=True)
    )
    return _profile(layers, draw(st.sampled_from(["fp32", "bf16"]))), dataclasses.replace(
        plan, stages=stages
    )


@FAST
@given(_plans())
def test_replay_equals_the_closed_form_and_the_simulator(case) -> None:
    """Under 1F1B and GPipe the compute-order replay is the phases' closed form, and the
    simulator's peak and the cost model's rows are both."""
    prof, plan = case
    ks, _ = in_flight_bounds(plan)
    closed = [
        stage_peak(prof, s, plan.micro_batch_size, k, plan.num_micro_batches).peak
        for s, k in zip(plan.stages, ks, strict=True)
    ]
    assert device_memory_by_group(plan, prof) == pytest.approx(closed)
    rows = [r.memory_bytes for r in pipeline_latency(plan, prof, make_cluster(1, 8)).stages]
    assert rows[::2] == pytest.approx(closed)
    sim = simulate(plan, prof, make_cluster(1, 8))
    for s, want in zip(plan.stages, closed, strict=True):
        assert sim.device(s.devices[0]).peak_memory_bytes == pytest.approx(want)


@FAST
@given(_plans(), st.integers(0, 60_000))
def test_in_flight_limit_is_the_most_that_fits(case, memory: int) -> None:
    """D from :func:`in_flight_limit` against trying every K from 1 to M."""
    prof, plan = case
    M = plan.num_micro_batches
    for s in plan.stages:
        sb = plan_stage_bytes(prof, s, plan.micro_batch_size)
        fits = [
            k
            for k in range(1, M + 1)
            if stage_peak(prof, s, plan.micro_batch_size, k, M).peak <= memory
        ]
        assert min(in_flight_limit(sb, memory, M), M) == max(fits, default=0)
