"""Expert parallelism with ZeRO-1/2 (``dapple.runtime.parallel.expert``): the dense parameters
sharded over the stage's replicas as without EP; at e_s = r_s the expert shards left out of the
flat buckets (each replica updates its own experts whole), below it sharded over the r_s/e_s
replicas holding each (their own buckets, :class:`~dapple.runtime.parallel.zero.ShardGroup`);
``dapple verify`` equal to one device under AdamW, and checkpoints whole that resume under
another width and zero stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import runtime_workloads as rw
from dapple.core.plan import straight_plan
from dapple.runtime.parallel.zero import FlatShards, ShardGroup, flat_parameters
from dapple.runtime.verify.run import WORKER_SETUP_ENV
from ep_runs import (
    ResumeCase,
    append_row,
    plan_1_2_1,
    plan_4_1,
    rows,
    run_and_check_resumes,
    verify_equal_to_one_device,
)

ZERO_DIR_ENV = "DAPPLE_TEST_EP_ZERO_DIR"
"""Where :func:`record_zero` writes what each verify worker's ZeRO shards."""


def record_zero(rank: int) -> None:
    """Verify worker setup hook: append, per run, the rank's zero stage, its flat (sharded)
    parameters' count and how many of them are expert shards, to
    ``$DAPPLE_TEST_EP_ZERO_DIR/rank<r>.jsonl``."""
    import dapple.runtime.startup as startup

    select = startup.select_zero

    def recorded(plan: Any, workload: Any, layers: Any, zero_stage: int, mesh: Any = None) -> Any:
        sel = select(plan, workload, layers, zero_stage, mesh)
        ep = mesh.experts if mesh is not None else None
        ids = ep.param_ids if ep is not None else frozenset()
        row = {"zero": sel.zero_stage, "flat": len(sel.flat), "held": len(sel.held),
               "flat_experts": sum(id(p) in ids for p in sel.flat), "experts": len(ids),
               "copies": sorted({g.devices for g in sel.held.values()})}  # fmt: skip
        append_row(ZERO_DIR_ENV, rank, row)
        return sel

    startup.select_zero = recorded


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_held_parameters_are_bucketed_and_sharded_over_their_copies_only(zero_stage: int) -> None:
    """On a stage of r = 4, the parameters of one layer held by 2 copies (as expert shards at
    e_s = 2): their buckets hold nothing else, are padded to a multiple of 2 and cut in 2
    chunks, so the 2 copies' pieces cover each of their elements once; the other buckets are
    cut in 4, the 4 replicas' pieces covering each element once."""
    wl = rw.mlp()
    plan = straight_plan(4, [0, 1], global_batch_size=8, num_micro_batches=2, replicas=[1, 4])
    devices = plan.stages[1].replica_devices
    built = []
    for j in range(4):
        module = wl.build_stage(1, 4, 0)
        copies = ShardGroup((devices[j % 2], devices[j % 2 + 2]), None, j // 2)
        held = {id(p): copies for p in module[1].parameters()}
        sh = FlatShards(plan, 1, j, module, flat_parameters(plan, wl, 1, module), None,
                        zero_stage, bucket_bytes=100, held=held)  # fmt: skip
        built.append((module, sh))
        for bk in sh.buckets:
            mine = {id(p) in held for p in bk.params}
            assert len(mine) == 1, "a bucket mixes held and stage parameters"
            group = copies if mine == {True} else sh.stage_group
            assert bk.group == group and bk.padded % group.size == 0
        assert sum(bk.group == copies for bk in sh.buckets) >= 2  # the layer's two tensors
        sh.close()
    for members in ((0, 2), (1, 3), (0, 1, 2, 3)):  # each copy group; the stage's replicas
        for k, p0 in enumerate(built[0][1].params):
            if any(p0 is q for q in built[0][0][1].parameters()) != (len(members) == 2):
                continue
            hits = torch.zeros(p0.numel())
            for j in members:
                module, sh = built[j]
                for pc in sh.pieces:
                    if pc.origin is sh.params[k]:
                        hits[pc.offset : pc.offset + pc.param.numel()] += 1
            assert torch.equal(hits, torch.ones(p0.numel())), (members, k)


@pytest.mark.slow
def test_verify_moe_with_ep_2_under_zero_1_and_2_equals_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch, two runs of 3 AdamW steps on 1:2:1 (the middle stage's 2 replicas, slices
    of 2 and 1 samples, each holding 2 of the 4 experts of both MoE blocks): Mixtral with the
    stage at ZeRO-1, Qwen2-MoE at ZeRO-2; both equal one device, and the middle stage's
    replicas shard their dense parameters and no expert."""
    pytest.importorskip("transformers")
    monkeypatch.setenv(WORKER_SETUP_ENV, "test_expert_zero:record_zero")
    monkeypatch.setenv(ZERO_DIR_ENV, str(tmp_path))
    verify_equal_to_one_device(
        [(plan_1_2_1(zero_stage=1), "mixtral"), (plan_1_2_1(zero_stage=2), "qwen2_moe")], 600
    )
    for r in (1, 2):  # the middle stage's replicas
        got = rows(tmp_path, r)
        assert [x["zero"] for x in got] == [1, 2], got
        assert all(x["flat"] > 0 and x["flat_experts"] == 0 and x["experts"] == 4 for x in got)


ZERO_RESUMES = ResumeCase(
    {"plain": plan_1_2_1(1), "ep-zero1": plan_1_2_1(2, zero_stage=1),
     "ep-zero2": plan_1_2_1(2, zero_stage=2)},
    ("plain", "ep-zero1"),
    (("ep-zero1", "plain"), ("ep-zero1", "ep-zero2")),
)  # fmt: skip
"""Mixtral on 1:2:1 without EP and with EP 2 under ZeRO-1; the latter's checkpoint resumed
without EP and under EP 2 with ZeRO-2."""


@pytest.mark.slow
def test_checkpoints_of_ep_with_zero_are_whole_and_resume_under_another_width_and_zero(
    tmp_path: Path,
) -> None:
    """The EP 2 + ZeRO-1 run's checkpoints hold what the plain run's do (whole ``[4, ...]``
    experts and every AdamW moment, within rounding), and its step-2 checkpoint resumed without
    EP and under EP 2 + ZeRO-2 ends where the uninterrupted runs do
    (:func:`ep_runs.run_and_check_resumes`)."""
    pytest.importorskip("transformers")
    _, want = run_and_check_resumes(tmp_path, ZERO_RESUMES, 4)
    moments = [
        k for k in want if k.endswith(("gate_up_proj/exp_avg", "self_attn.q_proj.weight/exp_avg"))
    ]
    assert len(moments) == 4 and all(want[k].abs().sum() > 0 for k in moments), moments


@pytest.mark.slow
def test_verify_moe_with_ep_2_of_4_replicas_under_zero_1_and_2_equals_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch, two runs of 3 AdamW steps on 4:1 with EP 2 on the first stage (two expert
    groups: each expert shard held by 2 replicas, e_s < r_s): Mixtral at ZeRO-1, Qwen2-MoE at
    ZeRO-2; both equal one device, and each of the stage's replicas shards its expert shards
    over their 2 copies (replicas 0 and 2, 1 and 3), the rest over all 4."""
    pytest.importorskip("transformers")
    monkeypatch.setenv(WORKER_SETUP_ENV, "test_expert_zero:record_zero")
    monkeypatch.setenv(ZERO_DIR_ENV, str(tmp_path))
    verify_equal_to_one_device(
        [(plan_4_1(2, zero_stage=1), "mixtral"), (plan_4_1(2, zero_stage=2), "qwen2_moe")], 900
    )
    for r in range(4):  # stage 0's replicas: devices 0-3
        got = rows(tmp_path, r)
        assert [x["zero"] for x in got] == [1, 2], got
        for x in got:
            assert x["experts"] > 0 and x["flat_experts"] == x["held"] == x["experts"], x
            assert x["flat"] > x["held"] and x["copies"] == [[r % 2, r % 2 + 2]], x


BELOW_R_RESUMES = ResumeCase(
    {"plain": plan_4_1(1), "ep2-zero1": plan_4_1(2, zero_stage=1),
     "ep4-zero2": plan_4_1(4, zero_stage=2)},
    ("plain", "ep2-zero1"),
    (("ep2-zero1", "plain"), ("ep2-zero1", "ep4-zero2")),
)  # fmt: skip
"""Mixtral on 4:1 without EP and with EP 2 under ZeRO-1 (each expert shard's state sharded
over its 2 copies); the latter's checkpoint resumed without EP and under EP 4 with ZeRO-2."""


@pytest.mark.slow
def test_checkpoints_of_ep_below_r_with_zero_are_whole_and_resume_under_another_width(
    tmp_path: Path,
) -> None:
    """The EP 2 + ZeRO-1 run on 4 replicas (experts' state sharded over each shard's 2 copies)
    writes checkpoints holding what the plain run's do (whole ``[4, ...]`` experts and every
    AdamW moment, within rounding), and its step-2 checkpoint resumed without EP and under
    EP 4 + ZeRO-2 ends where the uninterrupted runs do."""
    pytest.importorskip("transformers")
    _, want = run_and_check_resumes(tmp_path, BELOW_R_RESUMES, 5)
    moments = [k for k in want if k.endswith(("gate_up_proj/exp_avg", "down_proj/exp_avg_sq"))]
    assert len(moments) == 4 and all(want[k].shape[0] == 4 for k in moments), moments
