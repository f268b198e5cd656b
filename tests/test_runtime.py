"""Runtime: multi-process gloo runs of every plan shape against a single-process reference,
held-activation memory of DAPPLE vs GPipe, and the pure helpers (specs, meter, validation)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime_workloads as rw
from dapple.core.plan import interleave, straight_plan
from dapple.errors import ValidationError
from dapple.runtime import (
    ActivationMeter,
    BoundarySpec,
    StepMetrics,
    TrainConfig,
    resolve_workload,
    spawn,
    validate_run,
)

CONFIGS = rw.equivalence_configs()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Start 4 gloo workers ONCE; they loop over every configuration and report per rank."""
    out = tmp_path_factory.mktemp("runtime")
    spawn(rw.equivalence_worker, 4, str(out), timeout_s=60)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=[rw.config_id(c) for c in CONFIGS])
def test_parameters_match_single_process_reference(spawned: list[dict], cfg: dict) -> None:
    cid = rw.config_id(cfg)
    plan = rw.make_plan(cfg["plan"], cfg["schedule"], cfg["policy"], cfg["recompute"], 5, 3)
    for rank, rep in enumerate(spawned):
        res = rep["results"][cid]
        assert res["ok"], f"rank {rank}: {res.get('error')}"
        if rank in plan.devices:
            s, _ = plan.stage_of_device(rank)
            n_params = len(
                list(
                    rw.WORKLOADS[cfg["workload"]]().build_stage(*plan.stages[s].layers).parameters()
                )
            )
            assert res["checked"] == n_params > 0
    # rank 0 compared the loss of all 3 steps too (the list exists only if it did)
    assert len(spawned[0]["results"][cid]["losses"]) == 3


@pytest.mark.slow
def test_dapple_memory_flat_while_gpipe_grows(spawned: list[dict]) -> None:
    mem = spawned[0]["memory"]
    for rc in (0, 1):
        dapple = [mem[f"dapple-{rc}-{m}"] for m in (2, 4, 8, 16)]
        gpipe = [mem[f"gpipe-{rc}-{m}"] for m in (2, 4, 8, 16)]
        assert all(d == dapple[0] for d in dapple), dapple  # K_i in flight, independent of M
        for stage in (0, 1):
            assert dapple[0][stage] > 0
            # GPipe holds all M micro-batches: exactly linear in M
            assert [g[stage] for g in gpipe] == [gpipe[0][stage] * k for k in (1, 2, 4, 8)]
    # re-computation keeps only stage inputs/outputs: strictly less held per stage
    for m in (2, 16):
        for stage in (0, 1):
            assert mem[f"dapple-1-{m}"][stage] < mem[f"dapple-0-{m}"][stage]


# ------------------------------------------------------------------------------ pure helpers
def test_boundary_spec_of_tuple_and_single() -> None:
    spec = BoundarySpec.of((torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)))
    assert spec.is_tuple
    assert [(t.dtype, t.sample_shape, t.carries_grad) for t in spec.tensors] == [
        (torch.float32, (4,), True),
        (torch.int64, (), False),
    ]
    single = BoundarySpec.of(torch.zeros(2, 5, 6))
    assert not single.is_tuple and single.tensors[0].sample_shape == (5, 6)
    assert single.tensors[0].buffer(7, torch.device("cpu")).shape == (7, 5, 6)
    with pytest.raises(TypeError, match="batch"):
        BoundarySpec.of(torch.tensor(1.0))


def test_activation_meter_counts_saved_tensors_once_and_releases() -> None:
    lin = nn.Linear(8, 8)
    meter = ActivationMeter(exclude=list(lin.parameters()))
    x = torch.randn(4, 8, requires_grad=True)
    held = meter.hold([x, x[:2]])  # same storage counted once
    assert meter.current_bytes == 4 * 8 * 4
    with meter.saved_tensors_hooks():
        y = torch.tanh(lin(x))  # saves x (already held) and tanh's output
    assert meter.current_bytes == 2 * 4 * 8 * 4
    y.sum().backward()
    del y
    for h in held:
        h.release()
    assert meter.current_bytes == 0
    assert meter.peak_bytes == 2 * 4 * 8 * 4
    meter.reset_peak()
    assert meter.peak_bytes == 0


def test_validate_run_rejects_mismatches() -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2, replicas=[2, 1])
    validate_run(plan, wl, 3)
    with pytest.raises(ValidationError, match="world size 4 != 3 devices"):
        validate_run(plan, wl, 4)
    with pytest.raises(ValidationError, match="model has 5 layers"):
        validate_run(plan, rw.mlp(5), 3)
    validate_run(dataclasses.replace(plan, schedule="zbh1"), wl, 3)
    validate_run(interleave(straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2), 2),
                 wl, 2)  # fmt: skip


def test_train_config_validation() -> None:
    with pytest.raises(ValidationError, match="optimizer"):
        TrainConfig(optimizer="lamb")
    with pytest.raises(ValidationError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValidationError, match="timeout_s"):
        TrainConfig(timeout_s=0)


def test_resolve_workload_specs() -> None:
    assert resolve_workload("runtime_workloads:mlp").name == "test-mlp"
    assert resolve_workload("runtime_workloads:tuple_chain").num_layers == 4
    with pytest.raises(ValidationError, match="has no callable 'nope'"):
        resolve_workload("runtime_workloads:nope")
    with pytest.raises(ValidationError, match="has no callable 'IN'"):
        resolve_workload("runtime_workloads:IN")
    with pytest.raises(ValidationError, match="unknown model 'nope'"):
        resolve_workload("nope")


def test_step_metrics_line() -> None:
    m = StepMetrics(
        step=2,
        loss=0.5,
        step_ms=12.5,
        samples_per_s=80.0,
        peak_memory_bytes=(2048, 10),
        memory_kind="held_activations",
        predicted_step_ms=11.0,
    )
    line = m.line()
    assert "step 2" in line and "12.5 ms (predicted 11.0 ms)" in line
    assert "s0=2.0KiB s1=10B" in line
    assert not math.isnan(m.to_dict()["loss"])
