"""DualPipeV (DeepSeek-V3 section 3.2.1, cut to a V): golden compute order; properties of the
order (each micro-batch's backward once, whole or I then W, the V's placement, no deadlock) and
of its lowering with uneven replication; the one-line refusals; the simulator against the step
rule and beside ZB-V; ``dapple simulate --schedule dualpipev``. The runtime:
``test_zbv_runtime``."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import NO_COMM, per_call_profile
from dapple.cli import main
from dapple.core.plan import straight_plan
from dapple.cost.compute import stage_compute_ms
from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
from dapple.errors import ValidationError
from dapple.schedule import ActionKind, compute_order, lower, validate, validate_compute_order
from dapple.schedule.dualpipev import dualpipev
from dapple.schedule.text_grid import format_grid
from dapple.schedule.zbv import v_group
from dapple.simulate import simulate
from dapple.simulate.plan_variants import with_schedule

K = ActionKind
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GOLDEN_P2_M4 = """\
step | rank 0 | rank 1
-----+--------+-------
0    | 0F0    | 1F0
1    | 0F1    | 2F0
2    | 0F2    | 1F1
3    | 3F0    | 2F1
4    | 3I0    | 1F2
5    | 3W0    | 2B0
6    | 3F1    | 2F2
7    | 0F3    | 1B0
8    | 3B1    | 1F3
9    | 3F2    | 2B1
10   | 0B0    | 2F3
11   | 3B2    | 1B1
12   | 3F3    | 2B2
13   | 0B1    | 1B2
14   | 3B3    | 2I3
15   | 0I2    | 1I3
16   | 0W2    | 2W3
17   | 0I3    | 1W3
18   | 0W3    |"""


def _straight(groups: int, per_group: int, M: int, reps: list[int] | None = None, b: int = 2):
    return straight_plan(
        groups * per_group,
        [g * per_group for g in range(groups)],
        global_batch_size=M * b,
        num_micro_batches=M,
        replicas=reps,
    )


def test_golden() -> None:
    assert format_grid(compute_order("dualpipev", 2, 4, v=2), column_label="rank") == GOLDEN_P2_M4


@FAST
@given(P=st.integers(2, 6), extra=st.integers(0, 12))
def test_order_runs_each_backward_once_whole_or_split_in_the_v(P: int, extra: int) -> None:
    M = 2 * P + extra
    order = dualpipev(P, M)
    validate_compute_order(order, P, M, 2, v_group)  # coverage, order, dependencies
    whole = split = 0
    for g, acts in order.items():
        assert {a.stage for a in acts} == {g, 2 * P - 1 - g}
        kinds: dict[tuple[int, int | None], list[ActionKind]] = {}
        for a in acts:
            kinds.setdefault((a.stage, a.micro_batch), []).append(a.kind)
        for ks in kinds.values():
            assert ks in ([K.FORWARD, K.BACKWARD], [K.FORWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT])
            whole += K.BACKWARD in ks
            split += K.BACKWARD not in ks
        assert len(kinds) == 2 * M
    assert whole and split  # whole beside forwards, split at the ends (section 3.2.1)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: dualpipev(2, 3), "M >= 2P = 4 micro-batches, got P=2, M=3, v=2"),
        (lambda: dualpipev(1, 4), "P >= 2 device groups"),
        (lambda: with_schedule(_straight(3, 2, 5), "dualpipev"), "M >= 2P = 6"),
        (lambda: with_schedule(_straight(2, 2, 4), "dualpipev", 4), "got virtual_stages 4"),
        (lambda: with_schedule(_straight(1, 4, 4), "dualpipev"), "DualPipeV needs at least 2"),
        (
            lambda: with_schedule(_straight(2, 1, 4), "dualpipev"),
            "DualPipeV cuts each device group into 2 chunks (a V over 2 groups: 4 chunks of at "
            "least one layer), but stage 0 (devices [0]) has 1 layer(s) [0, 1]",
        ),
    ],
)
def test_plans_it_cannot_express_are_refused_in_one_line(make, words: str) -> None:
    """Each refusal names DualPipeV, not ZB-V whose V it shares."""
    with pytest.raises(ValidationError) as e:
        make()
    assert words in str(e.value) and "\n" not in str(e.value)
    assert "ZB-V" not in str(e.value)


@FAST
@given(
    reps=st.lists(st.integers(1, 3), min_size=2, max_size=4),
    extra=st.integers(0, 4),
    b=st.integers(1, 6),
)
def test_lowered_with_uneven_replication_validates(reps: list[int], extra: int, b: int) -> None:
    z = with_schedule(_straight(len(reps), 2, 2 * len(reps) + extra, reps, b), "dualpipev")
    validate(lower(z), z)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_uniform_chunks_step_equals_the_rule_and_zbv(P: int) -> None:
    """F = I = W = 1 per chunk, free communication: ``6M + P - 1`` (ZB-V's), the rule's."""
    M = 3 * P
    prof = per_call_profile([1.0] * 2 * P, [2.0] * 2 * P, 8, 1.0)
    base = _straight(P, 2, M)
    d = with_schedule(base, "dualpipev")
    res = simulate(d, prof, NO_COMM)
    assert res.step_ms == pytest.approx(6 * M + P - 1)
    assert schedule_latency(d, prof, NO_COMM) == pytest.approx(res.step_ms)
    assert res.step_ms == pytest.approx(simulate(with_schedule(base, "zbv"), prof, NO_COMM).step_ms)


@FAST
@given(
    times=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6)), min_size=2, max_size=8),
    reps=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    extra=st.integers(0, 4),
)
def test_uneven_chunks_sim_and_rule_bound_the_busiest_rank(times, reps, extra) -> None:
    P = len(reps)
    M = 2 * P + extra
    times = (times * 2 * P)[: 2 * P]
    prof = per_call_profile([float(f) for f, _ in times], [float(b) for _, b in times], 8, 1.0)
    z = with_schedule(_straight(P, 2, M, reps), "dualpipev")
    res = simulate(z, prof, NO_COMM)
    b = z.micro_batch_size
    work = max(
        sum(sum(stage_compute_ms(prof, NO_COMM, z.stages[k], b)) for k in z.stages_of_group(g))
        for g in range(P)
    )
    for t in (res.step_ms, schedule_latency(z, prof, NO_COMM)):
        assert M * work - 1e-6 <= t
    memory = device_memory_by_group(z, prof)
    for g in range(P):
        assert res.device(z.stages[g].devices[0]).peak_memory_bytes == pytest.approx(memory[g])


def test_cli_simulate_draws_the_dualpipev_gantt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, cluster, plan = tmp_path / "p.json", tmp_path / "c.json", tmp_path / "plan.json"
    per_call_profile([1.0] * 6, [2.0] * 6, 8, 1.0).save(prof)
    NO_COMM.save(cluster)
    _straight(3, 2, 6, [2, 1, 1]).save(plan)
    gantt = tmp_path / "dpv.svg"
    argv = ["simulate", "--plan", str(plan), "--profile", str(prof), "--cluster", str(cluster)]
    assert main([*argv, "--schedule", "dualpipev", "--gantt", str(gantt)]) == 0
    out = capsys.readouterr().out
    assert "DualPipeV, 2:1:1, M=6 on no-comm" in out and f"wrote {gantt}" in out
    assert gantt.stat().st_size > 0
