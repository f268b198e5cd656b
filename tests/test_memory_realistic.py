"""The step-peak memory model (dapple.cost.peak_memory) against measured peaks.

Golden: one H200 at Llama-3-8B shapes (shared/evidence/h200-2026-11-28/run2-realistic.md:
2 blocks, seq 4,096, global batch 2, AdamW, bf16 autocast over fp32 weights,
``torch.cuda.max_memory_allocated`` of dapple's runtime): 1 stage 35,365 MiB; 1:1 with M = 2,
stage 0 14,523 and stage 1 (LM head and loss, vocabulary 128,256) 20,043. The model is fed an
analytic profile of those shapes, never the measurement. CPU: live tensor bytes of the same
structure at a small width (benchmarks/gpu_memory_fit.py).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from dapple.core.plan import straight_plan
from dapple.cost.memory import parameter_state_bytes, uncast_bytes, weight_cast_bytes
from dapple.cost.peak_memory import (
    CUDA_WORKSPACE_BYTES,
    cast_bytes,
    loss_bytes,
    stage_peak,
    workspace_bytes,
)
from dapple.cost.pipeline import in_flight_bounds
from dapple.errors import ValidationError
from dapple.profiler.analytic import analytic_profile
from dapple.profiler.analytic_autocast import (
    autocast_block_kept_bytes,
    autocast_profile,
    cast_parameters,
)
from dapple.profiler.analytic_presets import PRESETS

MIB = 2**20
MEASURED_MIB = {("1 stage", 0): 35365, ("1:1", 0): 14523, ("1:1", 1): 20043}
"""run2-realistic.md, the planned-vs-measured table (dapple at commit 81351c0, one H200)."""

SPEC = dataclasses.replace(PRESETS["llama3-8b"], name="llama3-8b-2l", layers=2, seq=4096)


def _profile():
    return autocast_profile(analytic_profile(SPEC, "h100", precision="bf16"), SPEC)


def _plans():
    return {
        "1 stage": straight_plan(4, [0], global_batch_size=2, num_micro_batches=1),
        "1:1": straight_plan(4, [0, 2], global_batch_size=2, num_micro_batches=2),
    }


def _peaks(profile, workspace: float = CUDA_WORKSPACE_BYTES):
    out = {}
    for name, plan in _plans().items():
        ks, _ = in_flight_bounds(plan)
        for i, (st, k) in enumerate(zip(plan.stages, ks, strict=True)):
            out[(name, i)] = stage_peak(
                profile, st, plan.micro_batch_size, k, plan.num_micro_batches, workspace=workspace
            )
    return out


@pytest.mark.parametrize("key", sorted(MEASURED_MIB))
def test_realistic_prediction_within_10_percent_of_the_h200(key):
    predicted = _peaks(_profile())[key].peak / MIB
    assert predicted == pytest.approx(MEASURED_MIB[key], rel=0.10), (key, predicted)


@pytest.mark.parametrize("key", sorted(MEASURED_MIB))
def test_the_planner_reads_the_same_peaks(key):
    """The cost model's rows (what the planner fits into a device) and the schedule replay are
    the step peak: with the CUDA workspaces (a cluster's reserved bytes) within 10% of the H200."""
    from dapple.core.cluster_presets import PRESETS
    from dapple.cost.pipeline import pipeline_latency
    from dapple.cost.schedule_step import device_memory_by_group

    name, i = key
    plan, prof = _plans()[name], _profile()
    rows = [
        r for r in pipeline_latency(plan, prof, PRESETS["h200-8x"]).stages if r.kind == "compute"
    ]
    planned = rows[i].memory_bytes + CUDA_WORKSPACE_BYTES
    assert planned == pytest.approx(_peaks(prof)[key].peak)
    assert device_memory_by_group(plan, prof)[i] + CUDA_WORKSPACE_BYTES == pytest.approx(planned)
    assert planned / MIB == pytest.approx(MEASURED_MIB[key], rel=0.10)


def test_realistic_phases_are_those_the_accounting_names():
    peaks = _peaks(_profile())
    # one stage, M = 1: the loss's backward, no gradients yet
    assert peaks[("1 stage", 0)].phase == "first backward"
    assert peaks[("1 stage", 0)].later_backward == 0
    # 1:1: the second micro-batch's backward, every gradient present
    assert peaks[("1:1", 0)].phase == "later backward"
    assert peaks[("1:1", 1)].phase == "later backward"


def test_llama_block_kept_bytes_by_hand():
    # s = 4096, h = 4096, a d = 4096, f = 14336: 1024.5 MiB per sample (module docstring)
    s, h, f = 4096, 4096, 14336
    want = 4 * (4 * s * h + 2 * s) + 2 * 5 * s * h + 2 * 4 * s * h + 4 * 32 * s + 2 * s * s
    want += 2 * 4 * s * f
    assert autocast_block_kept_bytes(SPEC) == want
    assert want / MIB == pytest.approx(1024.53, abs=0.01)


def test_loss_bytes_are_fp32_logits_copies():
    prof = _profile()
    n = 4096 * 128256  # logits per sample
    assert loss_bytes(prof, 2) == (4.0 * n * 2, 8.0 * n * 2)


def test_embedding_is_not_cast_and_workspace_only_on_cuda():
    prof = _profile()
    emb, block = prof.layers[0], prof.layers[1]
    assert cast_bytes(prof, emb) == 0
    assert cast_bytes(prof, block) == 2 * cast_parameters(SPEC, "block0")
    assert workspace_bytes("cuda:0") == CUDA_WORKSPACE_BYTES
    assert workspace_bytes("cpu") == 0
    with pytest.raises(ValidationError, match="embedding, block"):
        cast_parameters(SPEC, "head")


def test_cast_cache_leaves_out_what_autocast_does_not_cast():
    prof = _profile()
    unsaid = dataclasses.replace(
        prof, layers=tuple(dataclasses.replace(x, cast_parameter_bytes=None) for x in prof.layers)
    )
    table = 128256 * 4096  # embedding parameters: looked up, never cast
    assert uncast_bytes(unsaid, (0, 2)) == 0
    assert uncast_bytes(prof, (0, 1)) == 2 * table
    assert weight_cast_bytes(prof, (0, 1)) == 0
    assert parameter_state_bytes(unsaid, (0, 2)) - parameter_state_bytes(prof, (0, 2)) == (
        2 * (table + 2 * 4096)  # 2 B per parameter of the table and block0's two norms
    )


def test_older_sum_bounds_the_first_stage_and_misses_the_loss():
    """The older sum (all gradients, a largest layer's gradient and K micro-batches at once)
    is above the step peak on stage 0 and below it on the loss stage."""
    prof = _profile()
    plan = _plans()["1:1"]
    peaks = _peaks(prof, workspace=0.0)
    for i, st in enumerate(plan.stages):
        kept = sum(x.kept_activation_bytes_per_sample for x in prof.layers[slice(*st.layers)])
        older = parameter_state_bytes(prof, st.layers) + (2 if i == 0 else 1) * kept
        assert (older > peaks[("1:1", i)].peak) == (i == 0)


def test_more_micro_batches_never_lower_the_peak():
    prof = _profile()
    for m in (2, 3, 4, 8):
        plan = straight_plan(4, [0, 2], global_batch_size=m, num_micro_batches=m)
        ks, _ = in_flight_bounds(plan)
        small = straight_plan(4, [0, 2], global_batch_size=m - 1, num_micro_batches=m - 1)
        ks1, _ = in_flight_bounds(small)
        for i in range(2):
            a = stage_peak(prof, small.stages[i], 1, ks1[i], m - 1).peak
            assert stage_peak(prof, plan.stages[i], 1, ks[i], m).peak >= a


def test_autocast_profile_refuses_other_models():
    gpt = PRESETS["gpt3-5b"]
    with pytest.raises(ValidationError, match="Llama-family"):
        autocast_profile(analytic_profile(gpt, "h100", precision="bf16"), gpt)
    with pytest.raises(ValidationError, match="bf16 or fp16"):
        autocast_profile(analytic_profile(SPEC, "h100", precision="fp32"), SPEC)


@pytest.mark.slow  # ~15 s of CPU: traces the model, runs 2 steps of 3 stages
def test_cpu_tensor_accounting_within_10_percent():
    """The runtime's step on this machine's CPU, one stage at a time, counted tensor by tensor
    (benchmarks/gpu_memory_fit.py: LiveBytes), against the same model's prediction."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_memory_fit

    rows = gpu_memory_fit.run_cpu(seq=512, steps=2)
    assert [(r["plan"], r["stage"]) for r in rows] == [
        ("1 stage", 0),
        ("1:1, M=2", 0),
        ("1:1, M=2", 1),
    ]
    # not vacuous: the counted peak is well above the parameters and AdamW moments alone
    prof = autocast_profile(
        analytic_profile(
            gpu_memory_fit.from_hf_config(gpu_memory_fit.SMALL, seq=512), "h100", precision="bf16"
        ),
        gpu_memory_fit.from_hf_config(gpu_memory_fit.SMALL, seq=512),
    )
    params = sum(x.parameter_bytes for x in prof.layers)
    assert rows[0]["counted"] > 1.5 * 3 * params
    for r in rows:
        assert r["predicted"] == pytest.approx(r["counted"], rel=0.10), r
        assert r["profiled"] == pytest.approx(r["counted"], rel=0.10), r  # the planner's path


def test_cast_parameter_bytes_round_trips_and_is_checked():
    from dapple.core.profile import ModelProfile

    prof = _profile()
    back = ModelProfile.from_dict(prof.to_dict())
    assert [x.cast_parameter_bytes for x in back.layers] == [
        x.cast_parameter_bytes for x in prof.layers
    ]
    assert back.layers[0].cast_parameter_bytes == 0
    with pytest.raises(ValidationError, match="cast_parameter_bytes"):
        dataclasses.replace(prof.layers[1], cast_parameter_bytes=prof.layers[1].parameter_bytes + 1)
