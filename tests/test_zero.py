"""ZeRO-1 inside replicated stages (:mod:`dapple.runtime.zero`).

Pure tiers first (the owner partition against brute force, the shards and broadcast runs of a
stage, option checks), then two multi-process runs (marked slow): ``verify`` with
``zero_stage=1`` under 1:3, 2:2, 1:2:1 and DP x4 (and a tied weight across two replicated
stages) with AdamW + a binding clip in one spawned group, and a checkpoint saved under 2:2 with ZeRO-1 (whole optimizer state in the layer files,
each replica's optimizer holding only its shard) resumed under the same plan (bit-exact), under
1:3 without sharding and under 1:3 sharded by 3 (bit-for-bit the unsharded 1:3), and a step
skipped for a non-finite loss (no shard updated, bit-for-bit the unsharded run).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import runtime_workloads as rw
from dapple import api
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan
from dapple.errors import ValidationError
from dapple.runtime.config import TrainConfig
from dapple.runtime.optim_config import OPTIM_FIELDS, ZERO_STAGES
from dapple.runtime.zero import StageShards, partition, unsharded_stages

G = 6
"""Global batch of the verify runs (divisible by 3 replicas x 2 micro-batches)."""


# -- the partition ------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=7), st.integers(1, 4))
def test_partition_is_the_greedy_least_loaded_assignment(sizes: list[int], r: int) -> None:
    owner = partition(sizes, r)
    assert len(owner) == len(sizes) and all(0 <= j < r for j in owner)
    assert partition(sizes, r) == owner  # deterministic: every replica computes the same
    # greedy bound: no replica exceeds the lightest by more than the largest parameter
    load = [sum(n for n, j in zip(sizes, owner, strict=True) if j == k) for k in range(r)]
    assert max(load) - min(load) <= max(sizes)
    # brute force over all assignments: the greedy max load is within 4/3 of the optimum
    # (Graham's bound for list scheduling is 2 - 1/r; in-order greedy on these sizes)
    if len(sizes) <= 6 and r <= 3:
        best = min(
            max(sum(n for n, j in zip(sizes, a, strict=True) if j == k) for k in range(r))
            for a in itertools.product(range(r), repeat=len(sizes))
        )
        assert max(load) <= (2 - 1 / r) * best


def test_partition_golden() -> None:
    assert partition([10, 10, 10, 10], 2) == [0, 1, 0, 1]
    assert partition([100, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert partition([5, 5, 5], 4) == [0, 1, 2]  # a replica may own nothing


def test_stage_shards_cover_the_stage_once_and_runs_follow_owners() -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 1], global_batch_size=G, num_micro_batches=2, replicas=[1, 3])
    module = wl.build_stage(1, 4, 0)
    shards = [StageShards(plan, 1, j, module, None, bucket_bytes=64) for j in range(3)]
    params = list(module.parameters())
    index = {id(p): k for k, p in enumerate(params)}
    owned = [id(p) for sh in shards for p in sh.owned]
    assert sorted(owned) == sorted(id(p) for p in params)  # each parameter once
    assert sum(sh.owned_fraction() for sh in shards) == pytest.approx(1.0)
    assert all(sh.owned_fraction() < 0.6 for sh in shards)
    for sh in shards:  # same broadcast order on every replica, each run one owner's
        assert [(j, [id(p) for p in ps]) for j, ps in sh.runs] == [
            (j, [id(p) for p in ps]) for j, ps in shards[0].runs
        ]
        for j, ps in sh.runs:
            assert all(sh.owner[index[id(p)]] == j for p in ps)
            assert len(ps) == 1 or sum(p.numel() * 4 for p in ps) <= 64
    assert unsharded_stages(plan) == [0]


# -- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "message"), [(2, "ZeRO-2"), (3, "got 3"), (-1, "got -1")])
def test_bad_zero_stage_is_named(value: int, message: str) -> None:
    with pytest.raises(ValidationError, match="zero_stage must be one of 0, 1") as e:
        TrainConfig(zero_stage=value)
    assert message in str(e.value)


def test_zero_stage_is_an_optimisation_option_verify_forwards() -> None:
    assert "zero_stage" in OPTIM_FIELDS and ZERO_STAGES == (0, 1)
    assert TrainConfig().zero_stage == 0


@pytest.mark.parametrize("cmd", ["train", "verify"])
def test_cli_zero_stage_flag_reaches_the_train_config(cmd: str) -> None:
    from dapple.cli import build_parser
    from dapple.cli._optim_args import optim_options

    args = build_parser().parse_args(
        [cmd, "--plan", "p.json", "--model", "mlp", "--zero-stage", "1"]
    )
    options = optim_options(args)
    assert options["zero_stage"] == 1
    assert TrainConfig(**options).zero_stage == 1
    default = build_parser().parse_args([cmd, "--plan", "p.json", "--model", "mlp"])
    assert optim_options(default)["zero_stage"] == 0


def test_cli_bad_zero_stage_is_one_line_before_any_compute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[2, 2])
    plan.save(tmp_path / "plan.json")
    ck = tmp_path / "ck"
    args = ["--plan", str(tmp_path / "plan.json"), "--model", "runtime_workloads:mlp",
            "--zero-stage", "2"]  # fmt: skip
    saving = ["--checkpoint-dir", str(ck), "--save-every", "1"]
    for cmd in ("train", "verify"):
        assert main([cmd, *args, *(saving if cmd == "train" else [])]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dapple: error:"), err
        assert "zero_stage" in err[0] and "ZeRO-2" in err[0]
    assert not ck.exists() or not any(ck.iterdir())  # nothing saved


def test_verify_report_names_the_zero_stage() -> None:
    from rich.console import Console

    from dapple.cli.verify_cmd import print_report
    from dapple.runtime.verify import StageDiff, VerifyReport

    plan = straight_plan(4, [0], global_batch_size=4, num_micro_batches=2, replicas=[4])
    stage = StageDiff(0, (0, 4), 4, 10, 0.0, 0.0, True)
    rep = VerifyReport(plan, "m", "layer chain", (stage,), (1.0,), (1.0,),
                       options={"steps": 1, "zero_stage": 1})  # fmt: skip
    for zero, shown in ((1, True), (0, False)):
        con = Console(record=True, width=160)
        print_report(con, dataclasses.replace(rep, options={"steps": 1, "zero_stage": zero}))
        assert ("zero stage 1" in con.export_text()) is shown


# -- multi-process ------------------------------------------------------------------------------
OPTS = dict(optimizer="adamw", lr=0.02, weight_decay=0.1, lr_schedule="cosine",
            warmup_steps=1, min_lr=0.002)  # fmt: skip
CLIP = 0.05
"""Below every step's global norm of the MLP runs: the clip binds on every step."""


@pytest.mark.slow
def test_verify_zero1_under_1_3_2_2_1_2_1_and_dp4() -> None:
    wl = api.load("runtime_workloads:mlp")
    shapes = [([0, 1], [1, 3]), ([0, 2], [2, 2]), ([0, 1, 3], [1, 2, 1]), ([0], [4])]
    plans = [
        straight_plan(
            4, cuts, global_batch_size=8 if reps == [4] else G, num_micro_batches=2, replicas=reps
        )
        for cuts, reps in shapes
    ]
    # a tied weight whose copies sit in two replicated stages (summed across stages, each copy
    # updated by its own stage's owner)
    tied = api.load("runtime_workloads:tied_mlp")
    cases = [(p, wl) for p in plans] + [(plans[1], tied)]
    steps = 3
    reports = api.verify_many(cases, steps, device="cpu", clip_grad_norm=CLIP, zero_stage=1,
                              **OPTS)  # fmt: skip
    for rep in reports:
        what = rep.plan.replication
        assert rep.options["zero_stage"] == 1
        assert rep.ok, (what, rep.max_abs_diff, rep.grad_norms, rep.reference_grad_norms)
        assert len(rep.grad_norms) == steps and min(rep.reference_grad_norms) > 4 * CLIP, what
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), what


RESUME = dict(optimizer="adam", lr=0.02, clip_grad_norm=0.3, seed=3, timeout_s=60)
STEPS, CUT = 5, 3
NAN_STEP = 1


def _nan_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``runtime_workloads`` MLP batches with a NaN input (a non-finite loss) at NAN_STEP."""
    x, y = rw._mlp_batch(n, seed)
    if seed == RESUME["seed"] + NAN_STEP:
        x[0, 0] = float("nan")
    return x, y


def resume_worker(rank: int, world: int, out_dir: str) -> None:
    """2:2 ZeRO-1 straight vs saved at CUT and resumed (2:2 ZeRO-1; 1:3 unsharded and ZeRO-1)."""
    from dapple.runtime import init_distributed, run_plan, shutdown_distributed
    from dapple.runtime.checkpoint import latest_checkpoint, load_layer_states

    device = init_distributed(TrainConfig(timeout_s=60), world)
    wl = rw.mlp()
    p22 = straight_plan(4, [0, 2], global_batch_size=6, num_micro_batches=2, replicas=[2, 2])
    p13 = straight_plan(4, [0, 1], global_batch_size=6, num_micro_batches=2, replicas=[1, 3])
    ck = str(Path(out_dir, "ck"))

    def run(plan, **kw: object):  # type: ignore[no-untyped-def]
        cfg = TrainConfig(**{**RESUME, "steps": STEPS, **kw})  # type: ignore[arg-type]
        return run_plan(plan, wl, cfg, device=device)

    full = run(p22, zero_stage=1)
    # the same sharding asked for per stage in the plan (run-wide zero_stage 0)
    p22z = dataclasses.replace(
        p22, stages=tuple(dataclasses.replace(st, zero_stage=1) for st in p22.stages)
    )
    planned = run(p22z)
    run(p22, zero_stage=1, checkpoint_dir=ck, save_every=CUT)  # saves at CUT only
    again = run(p22, zero_stage=1, checkpoint_dir=ck, resume=True)
    other = run(p13, checkpoint_dir=ck, resume=True)  # another plan, unsharded
    other1 = run(p13, zero_stage=1, checkpoint_dir=ck, resume=True)  # ... and re-sharded by 3
    # a non-finite loss with on_nonfinite=skip: no replica updates its shard or gathers
    nan_wl = dataclasses.replace(wl, make_batch=_nan_batch)
    skips = [
        run_plan(p22, nan_wl, TrainConfig(**{**RESUME, "steps": 3, "on_nonfinite": "skip",
                                             "zero_stage": z}), device=device)  # type: ignore[arg-type]
        for z in (0, 1)
    ]  # fmt: skip
    assert full.module is not None and again.module is not None and other.module is not None
    found = latest_checkpoint(ck)
    assert found is not None
    saved = load_layer_states(found, range(4))
    opt = full.optimizer
    lo, _ = p22.stages[full.stage or 0].layers
    state: dict[str, object] = {
        "same_weights": all(
            torch.equal(a, b)
            for a, b in zip(full.module.parameters(), again.module.parameters(), strict=True)
        ),
        # ZeRO-1 changes who updates a parameter, not the update: bit-for-bit stage 0's
        "other_same_sharded": all(
            torch.equal(a, b)
            for a, b in zip(other.module.parameters(), other1.module.parameters(), strict=True)
        ),
        "skip_same": all(
            torch.equal(a, b)
            for a, b in zip(skips[0].module.parameters(), skips[1].module.parameters(), strict=True)
        )
        and all(torch.isfinite(p).all() for p in skips[1].module.parameters()),
        "skip_lrs": [m.lr for m in skips[1].metrics],
        "other1_owned": len(other1.optimizer.state) if other1.optimizer is not None else 0,
        "other_params": len(list(other.module.parameters())),
        "stage_params": len(list(full.module.parameters())),
        "planned_same": all(
            torch.equal(a, b)
            for a, b in zip(full.module.parameters(), planned.module.parameters(), strict=True)
        ),
        "planned_owned": len(planned.optimizer.state) if planned.optimizer is not None else 0,
        "owned": len(opt.state) if opt is not None else 0,
        # every parameter of every layer has its Adam moments in the checkpoint
        "saved_complete": all(
            set(saved[i].optimizer) == set(saved[i].tensors)
            and all("exp_avg_sq" in v for v in saved[i].optimizer.values())
            for i in range(4)
        ),
        "other": _layers(other.module, p13.stages[other.stage or 0].layers[0]),
        "full": _layers(full.module, lo),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(state))
    shutdown_distributed()


def _layers(module: torch.nn.Module, first: int) -> dict[str, list[object]]:
    """``{chain index: [each parameter as nested lists]}`` of a stage's layers."""
    return {
        str(first + k): [p.detach().tolist() for p in layer.parameters()]
        for k, layer in enumerate(module.children())
    }


@pytest.mark.slow
def test_zero1_checkpoint_is_whole_and_resumes_under_another_plan(tmp_path: Path) -> None:
    from dapple.runtime import spawn

    spawn(resume_worker, 4, str(tmp_path), timeout_s=180)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, row in enumerate(rows):
        assert row["same_weights"], f"rank {r}: resumed weights differ from the straight run"
        assert row["saved_complete"], r
        assert row["other_same_sharded"], f"rank {r}: 1:3 ZeRO-1 differs from 1:3 unsharded"
        assert row["skip_same"], f"rank {r}: a skipped step differs under ZeRO-1"
        assert row["planned_same"] and row["planned_owned"] == row["owned"], r
    assert rows[0]["skip_lrs"][NAN_STEP] is None  # the step was skipped (no update)
    assert rows[0]["skip_lrs"][NAN_STEP + 1] is not None
    # 1:3 with ZeRO-1: stage 0 (one replica) keeps everything, stage 1 is sharded by 3
    assert rows[0]["other1_owned"] == rows[0]["other_params"]
    owned13 = [rows[r]["other1_owned"] for r in (1, 2, 3)]
    assert all(0 < n < rows[1]["other_params"] for n in owned13), owned13
    assert sum(owned13) == rows[1]["other_params"]
    # each replica's optimizer holds state for its shard only; the shards cover the stage
    for stage_ranks in ([0, 1], [2, 3]):
        owned = [rows[r]["owned"] for r in stage_ranks]
        assert all(0 < n < rows[stage_ranks[0]]["stage_params"] for n in owned), owned
        assert sum(owned) == rows[stage_ranks[0]]["stage_params"]
    # resumed under 1:3 without sharding: the same weights as the 2:2 ZeRO-1 run, to rounding
    full = {k: v for row in rows for k, v in row["full"].items()}
    for row in rows:
        for k, tensors in row["other"].items():
            for a, b in zip(tensors, full[k], strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


# -- the planner's memory and cost model (pure) --------------------------------------------------
def test_state_bytes_per_parameter_byte_shards_only_the_optimizer_moments() -> None:
    from builders import make_profile
    from dapple.planner.memory import state_bytes_per_parameter_byte

    adam = make_profile()  # factor 3: gradient + two moments
    assert state_bytes_per_parameter_byte(adam, 1) == 4.0
    assert state_bytes_per_parameter_byte(adam, 1, zero_stage=1) == 4.0  # one replica: no-op
    assert state_bytes_per_parameter_byte(adam, 4) == 5.0  # + the AllReduce buckets
    # parameters 1 + gradients 1 + moments 2/4 + buckets 1
    assert state_bytes_per_parameter_byte(adam, 4, zero_stage=1) == 3.5
    assert state_bytes_per_parameter_byte(adam, 2, zero_stage=1) == 4.0
    sgd = dataclasses.replace(adam, optimizer_state_factor=1.0)  # no moments: nothing to shard
    assert state_bytes_per_parameter_byte(sgd, 4, zero_stage=1) == 3.0


def test_plan_memory_and_sync_cost_under_zero1() -> None:
    from builders import make_cluster, make_profile
    from dapple.planner.comm import allreduce_ms, stage_sync_ms
    from dapple.planner.cost import pipeline_latency, zero_saved_bytes

    profile, cluster = make_profile(params=10**6), make_cluster()
    plan = straight_plan(6, [0, 3], global_batch_size=8, num_micro_batches=2, replicas=[1, 3])
    zero0 = pipeline_latency(plan, profile, cluster)
    zero1 = pipeline_latency(plan, profile, cluster, zero_stage=1)
    c0 = [r for r in zero0.stages if r.kind == "compute"]
    c1 = [r for r in zero1.stages if r.kind == "compute"]
    assert c1[0].memory_bytes == c0[0].memory_bytes  # one replica: unchanged
    assert zero_saved_bytes(profile, (0, 3), 1, 1) == 0.0
    saved = zero_saved_bytes(profile, (3, 6), 3, 1)
    assert saved == pytest.approx(3 * 10**6 * 2 * (1 - 1 / 3))  # two Adam moments, 2/3 of them
    assert c0[1].memory_bytes - c1[1].memory_bytes == pytest.approx(saved)
    assert c1[1].allreduce_ms == pytest.approx(1.5 * c0[1].allreduce_ms) and c0[1].allreduce_ms > 0
    assert stage_sync_ms(cluster, 1e6, [0], 1) == 0.0
    assert stage_sync_ms(cluster, 1e6, [0, 1], 0) == allreduce_ms(cluster, 1e6, [0, 1])


def test_search_finds_data_parallel_only_with_sharded_state() -> None:
    """One stage of 6 x 100 MB of Adam parameters needs 2.4 GB on one device, 3.0 GB per
    replica of DP x4 (the AllReduce buckets), 2.2 GB under ZeRO-1 with 3 replicas and 2.1 GB
    with 4: on 2.15 GB devices only sharded DP x4 fits."""
    from builders import make_cluster, make_profile
    from dapple.errors import InfeasibleError
    from dapple.planner.search import dapple_search

    profile = make_profile(params=10**8, act=10.0)
    cluster = dataclasses.replace(make_cluster(), device_memory_bytes=int(2.15e9))
    with pytest.raises(InfeasibleError):
        dapple_search(profile, cluster, 8, max_stages=1)
    plan = dapple_search(profile, cluster, 8, max_stages=1, zero_stage=1)
    assert plan.replication == "4"
    assert plan.stages[0].zero_stage == 1  # recorded in the plan, per stage
    assert Plan.from_dict(plan.to_dict()) == plan


def test_plan_json_carries_the_zero_stage_per_stage() -> None:
    from builders import make_cluster, make_profile
    from dapple.planner.cost import pipeline_latency

    plan = straight_plan(6, [0, 3], global_batch_size=8, num_micro_batches=2, replicas=[1, 3])
    assert all("zero_stage" not in st for st in plan.to_dict()["stages"])  # 0: left out
    sharded = dataclasses.replace(
        plan, stages=(plan.stages[0], dataclasses.replace(plan.stages[1], zero_stage=1))
    )
    d = sharded.to_dict()
    assert [st.get("zero_stage") for st in d["stages"]] == [None, 1]
    assert Plan.from_dict(d) == sharded
    bad = json.loads(json.dumps(d))
    bad["stages"][1]["zero_stage"] = 2
    with pytest.raises(ValidationError, match=r"plan stage 1: .*zero_stage must be 0 or 1, got 2"):
        Plan.from_dict(bad)
    # the cost model follows the stage's own choice
    profile, cluster = make_profile(params=10**6), make_cluster()
    own = pipeline_latency(sharded, profile, cluster)
    run_wide = pipeline_latency(plan, profile, cluster, zero_stage=1)
    assert [r.memory_bytes for r in own.stages] == [r.memory_bytes for r in run_wide.stages]
    assert own.L_ms == run_wide.L_ms


def test_cli_plan_prints_the_zero_choice_and_rejects_two(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dapple.cli.plan_cmd import _ZERO_STAGES

    assert _ZERO_STAGES == ZERO_STAGES
    base = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "--planner", "dp"]
    assert main([*base]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "stage 0 (r=16) zero stage 0, sharding would save" in out
    for bad in ("2", "x", "-1"):
        assert main([*base, "--zero-stage", bad]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dapple: error: --zero-stage must be one of")
        assert ("ZeRO-2" in err[0]) is (bad == "2")


def test_cli_plan_records_the_zero_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a"]
    assert main([*base, "--zero-stage", "1", "-o", str(tmp_path / "p.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    plan = Plan.load(tmp_path / "p.json")
    assert all(st.zero_stage == (st.replicas > 1) for st in plan.stages)
    assert "zero stage 1, saves" in out


def test_auto_shards_only_where_memory_asks() -> None:
    from builders import make_cluster, make_profile
    from dapple.planner.evaluate import ZERO_AUTO
    from dapple.planner.search import dapple_search

    profile = make_profile(params=10**8, act=10.0)
    tight = dataclasses.replace(make_cluster(), device_memory_bytes=int(2.15e9))
    plan = dapple_search(profile, tight, 8, max_stages=1, zero_stage=ZERO_AUTO)
    assert plan.replication == "4" and plan.stages[0].zero_stage == 1  # as zero_stage=1
    roomy = make_cluster()  # 16 GiB: nothing asks for sharding
    auto = dapple_search(profile, roomy, 8, zero_stage=ZERO_AUTO)
    assert auto == dapple_search(profile, roomy, 8)
    assert all(st.zero_stage == 0 for st in auto.stages)
