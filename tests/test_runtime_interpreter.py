"""The runtime's interpreter of lowered programs: compiled execution order, the step point,
failure messages with the marked schedule grid (a real failing layer in 2 gloo workers), and the
metrics probe and sink."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime_workloads as rw
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.runtime.interpreter import RECV_AHEAD, _compile
from dapple.runtime.launch.failure import GRID_MAX_DEVICES, failure_grid
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.metrics import MetricsSink, StepProbe
from dapple.runtime.step_metrics import StepMetrics
from dapple.runtime.step_point import point_of, step_point
from dapple.runtime.train_config import TrainConfig
from dapple.schedule.ir import Action, ActionKind, parse_action
from dapple.schedule.lower import lower

K = ActionKind


def _plan3():
    return straight_plan(4, [0, 2, 3], global_batch_size=8, num_micro_batches=4, replicas=[2, 1, 1])


def _order(program: list[Action]) -> list[int]:
    n = step_point({0: program}, 0)
    return [op.position for op in _compile(program[:n], lambda i: lambda a: None)]


# -- compiled order --------------------------------------------------------------------------
def test_compiled_order_posts_receives_early_golden() -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    program = lower(plan)[1]  # 1.0RECV_F0@0 1F0 1B0 1.0SEND_B0@0 1.0RECV_F1@0 1F1 1B1 ...
    assert [str(a) for a in program[:5]] == ["1.0RECV_F0@0", "1F0", "1B0", "1.0SEND_B0@0",
                                             "1.0RECV_F1@0"]  # fmt: skip
    # RECV_F1 (position 4) is posted right after RECV_F0, RECV_AHEAD = 4 positions before it
    assert _order(program) == [0, 4, 1, 2, 3, 5, 6, 7]


@pytest.mark.parametrize("dev", range(4))
def test_compiled_order_runs_every_action_once_receives_at_most_ahead(dev: int) -> None:
    program = lower(_plan3())[dev]
    order = _order(program)
    n = step_point({dev: program}, dev)
    assert sorted(order) == list(range(n))  # every action before the step point, once
    others = [i for i in order if program[i].kind not in (K.RECV_F, K.RECV_B)]
    assert others == sorted(others)  # F, B and sends keep their program order
    for rank_in_order, i in enumerate(order):
        if program[i].kind in (K.RECV_F, K.RECV_B):
            before = order[:rank_in_order]
            # posted after an action at most RECV_AHEAD positions before it, never later
            assert any(i - RECV_AHEAD <= j < i for j in before) or i == 0
            assert all(j < i for j in others if j in before)
    if dev == 2:  # 1.0RECV_F0@0 1.0RECV_F0@1 1F0 1.0SEND_F0@0 1.0RECV_F1@0 1.0RECV_F1@1 ...
        # RECV_F1@0 (4) moves up behind position 0, RECV_F1@1 (5) behind 1F0 (2); position 1,
        # posted early, posts nothing ahead
        assert order[:6] == [0, 1, 4, 2, 5, 3]


def test_step_point_is_the_first_ar_agree_post_or_opt() -> None:
    sched = lower(_plan3())
    assert [str(sched[0][step_point(sched, 0)]), str(sched[2][step_point(sched, 2)])] == [
        "0AR",
        "1AGREE",
    ]
    assert step_point({0: []}, 0) == 0 and step_point({}, 5) == 0  # a rank beyond the plan


def test_a_program_whose_step_point_is_not_the_guards_is_refused() -> None:
    """The interpreter runs the program's step point (``POST``: rows read a step late), which
    must be the one of the guard's ``on_nonfinite``; a rank beyond the plan runs the guard's."""
    sched = lower(_plan3(), on_nonfinite="off")
    tail = sched[2][step_point(sched, 2) :]
    assert [str(a) for a in tail] == ["1POST", "1OPT"]
    assert point_of(tail, "off", 2) is K.POST
    assert point_of([], "skip", 5) is K.AGREE
    with pytest.raises(ValidationError, match="rank 2: the program's step point is POST but "
                       "on_nonfinite 'stop' runs AGREE"):  # fmt: skip
        point_of(tail, "stop", 2)


def test_step_point_rejects_actions_after_the_first_ar_opt_with_the_grid() -> None:
    prog = [parse_action(x) for x in ("0F0", "0OPT", "0B0")]
    with pytest.raises(ValidationError, match="program has actions after its first AR/OPT") as e:
        step_point({0: prog, 1: [parse_action("1F0")]}, 0)
    assert ">>0B0<<" in str(e.value) and "dev 1" in str(e.value)


# -- failure grid ----------------------------------------------------------------------------
def test_failure_grid_marks_the_action_and_keeps_large_grids_narrow() -> None:
    sched = lower(_plan3())
    grid = failure_grid(sched, 2, 6)
    assert ">>1F1<<" in grid and all(f"dev {d}" in grid for d in range(4))
    big = {d: [parse_action(f"{d}F0"), parse_action(f"{d}B0")] for d in range(GRID_MAX_DEVICES + 1)}
    narrow = failure_grid(big, 3, 1, peer=4)
    assert ">>3B0<<" in narrow
    assert [c.strip() for c in narrow.splitlines()[0].split(" | ")[1:]] == ["dev 3", "dev 4"]


class _FailsOnSecondCall(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("layer exploded")
        return self.inner(x)


def failing_worker(rank: int, world: int, out_dir: str) -> None:
    from dapple.runtime import TrainConfig, init_distributed, run_plan

    device = init_distributed(TrainConfig(timeout_s=30), world)
    base = rw.mlp()
    factories = list(base.layer_factories)
    last = factories[3]
    factories[3] = lambda: _FailsOnSecondCall(last())
    wl = Workload(base.name, factories, base.make_batch, base.loss_fn)
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    try:
        run_plan(plan, wl, TrainConfig(steps=2, timeout_s=30), device=device)
        res = {"error": None}
    except Exception as e:
        res = {"error": str(e), "type": type(e).__name__}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)  # peers may be gone: no process-group teardown


@pytest.mark.slow
def test_failing_action_shows_the_schedule_grid_with_it_marked(tmp_path: Path) -> None:
    from dapple.runtime import spawn

    spawn(failing_worker, 2, str(tmp_path), timeout_s=60)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    sched = lower(plan)
    # rank 1's layer raises in its second forward, 1F1 (position 5)
    assert r1["type"] == "RankFailure"
    head, _, grid = r1["error"].partition("\n")
    assert head == (
        "step 0: rank 1 (stage 1 replica 0) failed during action 1F1 (RuntimeError: layer exploded)"
    )
    assert grid == failure_grid(sched, 1, 5)
    assert ">>1F1<<" in grid and ">>" not in grid.replace(">>1F1<<", "")
    # rank 0 waits in 0B1 (position 7) for gradients that never come
    assert r0["type"] == "RankFailure"
    head0, _, grid0 = r0["error"].partition("\n")
    assert head0.startswith(
        "step 0: rank 0 (stage 0 replica 0) failed waiting for gradients of micro-batch 1; "
        "lost peer rank 1 (stage 1 replica 0)"
    ), head0
    assert grid0 == failure_grid(sched, 0, 7, peer=1) and ">>0B1<<" in grid0


# -- metrics ---------------------------------------------------------------------------------
def _rows() -> list[list[float]]:
    # [kind, stage, micro-batch, rank, loss part, peak bytes]; rank 3 is beyond the plan
    return [
        [-1, 0, -1, 0, 0.0, 100],
        [-1, 0, -1, 1, 0.0, 300],
        [-1, 1, -1, 2, 0.75, 50],
        [-1, -1, -1, 3, 0.0, 999],
    ]


def test_metrics_sink_writes_json_lines_echoes_and_calls_back(tmp_path: Path, capsys) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2, replicas=[2, 1])
    path = tmp_path / "m.jsonl"
    cfg = TrainConfig(metrics_path=str(path), echo=True, predicted_step_ms=9.0)
    seen: list[StepMetrics] = []
    sink = MetricsSink(plan, cfg, rank=0, memory_kind="held_activations", callbacks=[seen.append])
    sink.record(0, _rows(), 20.0)
    sink.record(1, _rows(), 40.0)
    sink.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["peak_memory_bytes"] == [300, 50]  # max over replicas; rank 3 left out
    assert rows[0]["loss"] == 0.75 and rows[1]["samples_per_s"] == 8 / 0.04
    assert rows[0]["predicted_step_ms"] == 9.0
    assert seen == sink.metrics and [m.step for m in seen] == [0, 1]
    assert capsys.readouterr().out.splitlines() == [m.line() for m in seen]
    other = MetricsSink(plan, cfg, rank=1, memory_kind="held_activations", callbacks=[seen.append])
    other.record(2, _rows(), 1.0)
    other.close()
    assert other.metrics == [] and len(seen) == 2
    assert MetricsSink(plan, TrainConfig(), rank=0, memory_kind="x").predicted_step_ms is None


def test_step_probe_meters_new_shapes_only() -> None:
    meter = ActivationMeter()
    probe = StepProbe(torch.device("cpu"), meter, None)
    x, y = torch.zeros(4, 3), torch.zeros(4, 1)
    probe.begin(x, y)
    held = meter.hold([torch.ones(10)])  # 40 bytes held during the metered step
    assert probe.peak_bytes() == 40
    for h in held:
        h.release()
    probe.lap()
    assert probe.step_ms > 0
    probe.begin(x, y)  # same shapes: the known peak, not metered again
    assert probe.peak_bytes() == 40
    probe.begin(torch.zeros(2, 3), torch.zeros(2, 1))  # new shapes: metered (nothing held)
    assert probe.peak_bytes() == 0 and probe._metering
    probe.begin(x, y)  # the first shapes again: their peak, not metered again
    assert not probe._metering and probe.peak_bytes() == 40
    probe.begin(torch.zeros(2, 3), torch.zeros(2, 1))
    assert not probe._metering and probe.peak_bytes() == 0
