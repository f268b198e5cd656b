"""The runtime's measured timeline (``DAPPLE_TIMELINE``): one record per action of the
rank's program per step, in order, with the step's wall and CPU time; nothing without it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import runtime_workloads as rw
from dapple.core.plan import straight_plan
from dapple.runtime import TrainConfig, run_plan
from dapple.runtime.timeline import ENV
from dapple.schedule.ir import STEP_POINTS, ActionKind
from dapple.schedule.lower import lower

STEPS, M = 3, 4


def _run(steps: int = STEPS) -> None:
    plan = straight_plan(4, [0], global_batch_size=2 * M, num_micro_batches=M)
    cfg = TrainConfig(steps=steps, seed=0, optimizer="sgd", lr=0.01, timeout_s=60)
    run_plan(plan, rw.mlp(4), cfg, device=torch.device("cpu"))


def test_each_step_records_every_action_of_the_program_in_order(
    world_of_one, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV, str(tmp_path))
    _run()
    (f,) = tmp_path.glob("timeline-*.json")
    d = json.loads(f.read_text())
    assert d["rank"] == 0 and d["steps"] == list(range(STEPS))
    plan = straight_plan(4, [0], global_batch_size=2 * M, num_micro_batches=M)
    program = lower(plan)[0]
    fields = d["fields"]
    for recs in d["records"]:
        rows = [dict(zip(fields, r, strict=True)) for r in recs]
        acts, (step, proc) = rows[:-2], rows[-2:]
        # the step point (the guard's collective) runs between OPT's two parts, each a record
        ran = [(i, a) for i, a in enumerate(program) if a.kind not in STEP_POINTS]
        opt = [x for x in ran if x[1].kind is ActionKind.STEP]
        assert [(r["position"], r["kind"], r["micro_batch"]) for r in acts] == [
            (i, a.kind.value, a.micro_batch) for i, a in ran + opt
        ]
        starts = [r["start_ms"] for r in acts]
        assert starts == sorted(starts) and all(r["end_ms"] >= r["start_ms"] for r in acts)
        assert acts[-1]["end_ms"] <= step["end_ms"] == proc["end_ms"]
        assert (step["kind"], proc["kind"]) == ("STEP", "PROCESS")
        assert all(r["cpu_ms"] >= 0 for r in rows)
        assert sum(r["kind"] == "F" for r in acts) == M


def test_without_the_variable_nothing_is_written_or_wrapped(world_of_one, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _run(steps=1)
    assert not list(Path(tmp_path).rglob("timeline-*.json"))
