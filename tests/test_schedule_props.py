"""Properties of GPipe vs DAPPLE schedules on random plans (hypothesis, small example counts).

Findings checked here (zero communication cost):

* uniform stages: GPipe and DAPPLE (policy A and B) take exactly the same step time,
  ``(M + S - 1) (F + B)`` - the paper's "same bubble time" claim (section 4.2);
* non-uniform stages: the step times may differ, and in every case we tried DAPPLE was never
  slower than GPipe - often faster, because a slow stage's backwards start before all M
  forwards have drained through the pipeline. The property below asserts ``DAPPLE <= GPipe``.

Peak in-flight micro-batches per stage are ``min(K_i, M)`` under DAPPLE and M under GPipe,
and the validator accepts every lowered schedule and rejects mutated ones.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import NO_COMM, per_call_profile
from dapple.core.plan import Plan, StagePlan
from dapple.errors import ValidationError
from dapple.schedule import ActionKind, compute_order, lower, warmup_counts
from dapple.schedule.validate import validate, validate_compute_order
from dapple.simulate import simulate

K = ActionKind
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _plan(
    S: int,
    M: int,
    schedule: str,
    policy: str = "A",
    replicas: list[int] | None = None,
    b: int = 1,
    D: list[int | None] | None = None,
) -> Plan:
    reps = replicas or [1] * S
    stages, dev = [], 0
    for s in range(S):
        stages.append(
            StagePlan(
                layers=(s, s + 1),
                devices=tuple(range(dev, dev + reps[s])),
                max_in_flight=None if D is None else D[s],
            )
        )
        dev += reps[s]
    return Plan(
        planner="test",
        global_batch_size=b * M,
        micro_batch_size=b,
        num_micro_batches=M,
        stages=tuple(stages),
        schedule=schedule,  # type: ignore[arg-type]
        policy=policy,  # type: ignore[arg-type]
    )


@FAST
@given(
    S=st.integers(1, 6),
    M=st.integers(1, 10),
    f=st.floats(0.1, 5.0),
    b=st.floats(0.1, 10.0),
)
def test_uniform_stages_same_step_time(S, M, f, b):
    prof = per_call_profile([f] * S, [b] * S)
    g = simulate(_plan(S, M, "gpipe"), prof, NO_COMM).step_ms
    assert g == pytest.approx((M + S - 1) * (f + b))
    for policy in "AB":
        assert simulate(_plan(S, M, "dapple", policy), prof, NO_COMM).step_ms == pytest.approx(g)


@FAST
@given(data=st.data(), S=st.integers(2, 6), M=st.integers(1, 10))
def test_non_uniform_stages_dapple_never_slower(data, S, M):
    fwd = data.draw(st.lists(st.floats(0.1, 5.0), min_size=S, max_size=S))
    bwd = data.draw(st.lists(st.floats(0.1, 10.0), min_size=S, max_size=S))
    prof = per_call_profile(fwd, bwd)
    g = simulate(_plan(S, M, "gpipe"), prof, NO_COMM).step_ms
    for policy in "AB":
        d = simulate(_plan(S, M, "dapple", policy), prof, NO_COMM).step_ms
        assert d <= g + 1e-9


def test_non_uniform_example_where_dapple_is_faster():
    # S = 3, M = 2; F = [5, 1, 5], B = [5, 8, 1]: GPipe 38 ms, DAPPLE 33 ms (found by search).
    prof = per_call_profile([5.0, 1.0, 5.0], [5.0, 8.0, 1.0])
    assert simulate(_plan(3, 2, "gpipe"), prof, NO_COMM).step_ms == pytest.approx(38.0)
    assert simulate(_plan(3, 2, "dapple"), prof, NO_COMM).step_ms == pytest.approx(33.0)


@st.composite
def plans(draw, schedule: str | None = None):
    S = draw(st.integers(1, 4))
    M = draw(st.integers(1, 6))
    reps = draw(st.lists(st.integers(1, 3), min_size=S, max_size=S))
    b = draw(st.integers(1, 4))  # may be smaller than a replica count: empty slices
    D = draw(st.lists(st.one_of(st.none(), st.integers(1, 4)), min_size=S, max_size=S))
    sched = schedule or draw(st.sampled_from(["gpipe", "dapple"]))
    return _plan(S, M, sched, draw(st.sampled_from("AB")), reps, b, D)


@FAST
@given(plan=plans())
def test_peak_in_flight(plan):
    prof = per_call_profile([1.0] * plan.num_stages, [2.0] * plan.num_stages)
    r = simulate(plan, prof, NO_COMM)
    M = plan.num_micro_batches
    ks = warmup_counts(plan.num_stages, M, plan.policy, [s.max_in_flight for s in plan.stages])
    for d in r.devices:
        if d.busy_ms == 0:  # replica with an empty slice
            assert d.peak_in_flight == 0
        elif plan.schedule == "gpipe":
            assert d.peak_in_flight == M
        else:
            assert d.peak_in_flight == min(ks[d.stage], M)


@FAST
@given(plan=plans())
def test_validator_accepts_generated_schedules(plan):
    order = compute_order(
        plan.schedule,
        plan.num_stages,
        plan.num_micro_batches,
        plan.policy,
        [s.max_in_flight for s in plan.stages],
    )
    validate_compute_order(order, plan.num_stages, plan.num_micro_batches)
    validate(lower(plan), plan)


def _active_devices(sched, kind):
    return [d for d, prog in sched.items() if any(a.kind is kind for a in prog)]


@FAST
@given(plan=plans(), seed=st.integers(0, 2**16))
def test_validator_rejects_b_before_f(plan, seed):
    rng = random.Random(seed)
    sched = lower(plan)
    dev = rng.choice(_active_devices(sched, K.FORWARD))
    prog = sched[dev]
    m = rng.randrange(plan.num_micro_batches)
    i = next(i for i, a in enumerate(prog) if a.kind is K.FORWARD and a.micro_batch == m)
    j = next(i for i, a in enumerate(prog) if a.kind is K.BACKWARD and a.micro_batch == m)
    prog[i], prog[j] = prog[j], prog[i]
    with pytest.raises(ValidationError, match="before its forward"):
        validate(sched, plan)


@FAST
@given(plan=plans(), seed=st.integers(0, 2**16))
def test_validator_rejects_dropped_recv(plan, seed):
    rng = random.Random(seed)
    sched = lower(plan)
    devs = [d for d in sched if any(a.kind in (K.RECV_F, K.RECV_B) for a in sched[d])]
    if not devs:  # a single stage has no communication
        assert plan.num_stages == 1
        return
    prog = sched[rng.choice(devs)]
    idx = [i for i, a in enumerate(prog) if a.kind in (K.RECV_F, K.RECV_B)]
    del prog[rng.choice(idx)]
    with pytest.raises(ValidationError, match=r"needs RECV_[FB]\d+@\d+ \(missing\)"):
        validate(sched, plan)


@FAST
@given(plan=plans(), seed=st.integers(0, 2**16))
def test_validator_rejects_deadlocking_reorder(plan, seed):
    # Hoist a backward's gradient receive (and the backward after it) in front of the program
    # of a non-last stage: the device waits for a gradient of a micro-batch it has not sent
    # forward yet.
    rng = random.Random(seed)
    sched = lower(plan)
    devs = [d for d in sched if any(a.kind is K.RECV_B for a in sched[d])]
    if not devs:
        return
    prog = sched[rng.choice(devs)]
    i = rng.choice([i for i, a in enumerate(prog) if a.kind is K.RECV_B])
    prog.insert(0, prog.pop(i))
    with pytest.raises(ValidationError, match="deadlock: "):
        validate(sched, plan)
