"""``--zero-stage`` of ``train`` and ``verify`` as a floor under the plan's zero stages, 0-3.

The run's zero stage (``TrainConfig.zero_stage``) applies to every stage with more than one
replica per tensor index (:func:`dapple.runtime.parallel.stage_mesh.zero_floored`); 3 is written into
those stages, each then an FSDP2 root whose parameters are sharded over its replicas. The slow
test trains a 2:1 plan with a run-wide 3 on two gloo ranks and checks that the replicated
stage's parameters are sharded and end equal to one process's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime_workloads as rw
from dapple.cli._optim_args import zero_stage_flag
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.runtime import TrainConfig, spawn
from dapple.runtime.parallel.stage_mesh import check_mesh_run, zero_floored

G, M, STEPS, LR, SEED = 8, 2, 2, 0.05, 3


def test_the_floor_raises_only_replicated_stages() -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=G, num_micro_batches=M, replicas=[2, 1])
    assert zero_floored(plan, 0) is plan
    floored = zero_floored(plan, 3)
    assert [st.zero_stage for st in floored.stages] == [3, 0]
    assert zero_floored(floored, 1) is floored  # a stage's own higher zero stage stays
    assert [st.zero_stage for st in zero_floored(plan, 2).stages] == [2, 0]


def test_train_and_verify_take_zero_stage_3() -> None:
    assert [zero_stage_flag(v) for v in ("0", "1", "2", "3")] == [0, 1, 2, 3]
    with pytest.raises(ValidationError, match="got '4'"):
        zero_stage_flag("4")
    assert TrainConfig(zero_stage=3).zero_stage == 3


def test_a_run_wide_3_meets_the_per_stage_checks_before_any_compute() -> None:
    plan = straight_plan(4, [0], global_batch_size=G, num_micro_batches=M, replicas=[2])
    check_mesh_run(plan, rw.tied_mlp(), TrainConfig(zero_stage=2))  # ZeRO-2 is fine with ties
    with pytest.raises(ValidationError, match="ZeRO-3 on a stage holding tied parameters"):
        check_mesh_run(plan, rw.tied_mlp(), TrainConfig(zero_stage=3))
    with pytest.raises(ValidationError, match="fp16"):
        check_mesh_run(plan, rw.mlp(), TrainConfig(zero_stage=3, precision="fp16"))


def floor_worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.tensor import DTensor

    from dapple.runtime import init_distributed, run_plan, shutdown_distributed

    device = init_distributed(TrainConfig(timeout_s=60), world)
    plan = straight_plan(4, [0, 2], global_batch_size=G, num_micro_batches=M, replicas=[2, 1])
    wl = rw.mlp()
    cfg = TrainConfig(steps=STEPS, seed=SEED, optimizer="adam", lr=LR, timeout_s=60,
                      zero_stage=3)  # fmt: skip
    # with an update observer, run_plan gathers a cut stage's final weights whole by layer
    run = run_plan(plan, wl, cfg, device=device, on_update=lambda *_: None)
    ref_model, _ = rw.reference_run(wl, "adam", LR, SEED, G, STEPS)
    assert run.module is not None and run.stage is not None
    res: dict[str, Any] = {"stage": run.stage, "ok": True}
    res["sharded"] = [isinstance(p, DTensor) for p in run.module.parameters()]
    if run.whole is None:  # not cut: the module's own parameters are whole
        lo = plan.stages[run.stage].layers[0]
        whole: dict[int, dict[str, torch.Tensor]] = {}
        for n, p in run.module.named_parameters():
            k, _, name = n.partition(".")
            whole.setdefault(lo + int(k), {})[name] = p.detach()
    else:
        whole = run.whole
    try:
        for i, params in sorted(whole.items()):
            ref = dict(ref_model[i].named_parameters())
            for name, t in params.items():
                torch.testing.assert_close(t, ref[name].detach(), msg=f"layer {i} {name}")
    except AssertionError as e:
        res = {"ok": False, "error": str(e)[:2000]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    shutdown_distributed()


@pytest.mark.slow
def test_a_run_wide_3_shards_the_replicated_stage_and_trains_as_one_process(
    tmp_path: Path,
) -> None:
    spawn(floor_worker, 3, str(tmp_path), timeout_s=60)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(g["ok"] for g in got), got
    assert [g["stage"] for g in got] == [0, 0, 1]
    assert all(got[0]["sharded"]) and all(got[1]["sharded"]) and got[0]["sharded"]
    assert not any(got[2]["sharded"])  # one replica: nothing to shard
