"""ZeRO-1 and ZeRO-2 inside replicated stages (:mod:`dapple.runtime.parallel.zero`).

Pure tiers first (the flat layout: equal chunks of every bucket, each element in exactly one
replica's pieces, tied parameters sharded in slices; option checks; the planner's memory and cost),
then multi-process runs (marked slow): ``verify`` with ``zero_stage=1`` under 1:3, 2:2, 1:2:1
and DP x4 (and a tied weight across two replicated stages) with AdamW + a binding clip in one
spawned group, and a checkpoint saved under 2:2 with ZeRO-1 (whole optimizer state in the layer
files, each replica's optimizer holding only its shard) resumed under the same plan
(bit-exact), under 1:3 without sharding and under 1:3 sharded by 3 (the unsharded 1:3 to
float32 rounding), and a step skipped for a non-finite loss (no shard updated).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime_workloads as rw
from dapple import api
from dapple.cli import main
from dapple.core.parallelism import ZERO_STAGES, Parallelism
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.errors import ValidationError
from dapple.runtime.parallel.zero import (
    FlatShards,
    flat_parameters,
    tied_parameters,
    unsharded_stages,
)
from dapple.runtime.train_config import OPTIM_FIELDS, TrainConfig

G = 6
"""Global batch of the verify runs (divisible by 3 replicas x 2 micro-batches)."""


# -- the flat layout ----------------------------------------------------------------------------
@pytest.mark.parametrize(("r", "bucket_bytes"), [(3, 64), (2, 10**9), (4, 100)])
def test_flat_shards_split_every_bucket_evenly_and_cover_each_element_once(
    r: int, bucket_bytes: int
) -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 1], global_batch_size=12, num_micro_batches=2, replicas=[1, r])
    ref = [p.detach().clone() for p in wl.build_stage(1, 4, 0).parameters()]
    shards = []
    for j in range(r):
        module = wl.build_stage(1, 4, 0)
        flat = flat_parameters(plan, wl, 1, module)
        assert flat == list(module.parameters())
        sh = FlatShards(plan, 1, j, module, flat, None, 1, bucket_bytes=bucket_bytes)
        shards.append(sh)
        for p, want in zip(module.parameters(), ref, strict=True):  # views of the flat buffer
            assert torch.equal(p, want)
            assert p.untyped_storage().data_ptr() in {
                bk.flat.untyped_storage().data_ptr() for bk in sh.buckets
            }
        sh.close()
    # every replica updates exactly 1/r of every (padded) bucket
    sizes = {sum(pc.param.numel() for pc in sh.pieces) + _padding_owned(sh) for sh in shards}
    total = sum(bk.padded for bk in shards[0].buckets)
    assert sizes == {total // r} and all(bk.padded % r == 0 for bk in shards[0].buckets)
    assert len(shards[0].buckets) > 1 or bucket_bytes > 10**6
    # the pieces of all replicas cover every element of every parameter exactly once
    for k, p in enumerate(shards[0].params):
        hits = torch.zeros(p.numel())
        for sh in shards:
            for pc in sh.pieces:
                if pc.origin is sh.params[k]:
                    hits[pc.offset : pc.offset + pc.param.numel()] += 1
                    assert torch.equal(
                        pc.param, sh.params[k].reshape(-1)[pc.offset :][: pc.param.numel()]
                    )
        assert torch.equal(hits, torch.ones(p.numel())), k
    assert 0.0 < shards[0].owned_fraction() <= 1.0


def test_no_bucket_spans_two_chunks_of_an_interleaved_rank() -> None:
    wl = rw.mlp()
    plan = interleave(
        straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2, replicas=[2, 2]), 2
    )
    assert plan.layers_of_device(0) == (0, 2)  # chunks: layer 0 (stage 0), layer 2 (stage 2)
    chunks = [wl.build_stage(0, 1, 0), wl.build_stage(2, 3, 0)]
    module = torch.nn.Sequential(*chunks[0], *chunks[1])
    flat = flat_parameters(plan, wl, 0, module)
    held = [list(c.parameters()) for c in chunks]
    sh = FlatShards(plan, 0, 0, module, flat, None, 1, chunks=held, bucket_bytes=10**9)
    of = {id(p): c for c, ps in enumerate(held) for p in ps}
    assert [{of[id(p)] for p in bk.params} for bk in sh.buckets] == [{1}, {0}]
    sh.close()


def _padding_owned(sh: FlatShards) -> int:
    """Padding elements in ``sh``'s chunks (a bucket is padded to a multiple of r)."""
    n = 0
    for bk in sh.buckets:
        chunk = bk.padded // sh.r
        used = sum(p.numel() for p in bk.params)
        lo = sh.replica * chunk
        n += max(0, min(lo + chunk, bk.padded) - max(lo, used))
    return n


def test_zero1_gradients_land_in_their_buckets_without_zeroing() -> None:
    """A parameter's first gradient of the step is copied into its bucket (whatever the bucket
    held), later ones add to it in place, and a parameter without a gradient reads as zeros."""
    wl = rw.mlp()
    plan = straight_plan(4, [0, 1], global_batch_size=12, num_micro_batches=2, replicas=[1, 2])
    module = wl.build_stage(1, 4, 0)
    ref = wl.build_stage(1, 4, 0)
    sh = FlatShards(plan, 1, 0, module, flat_parameters(plan, wl, 1, module), None, 1,
                    bucket_bytes=100)  # fmt: skip
    for p in sh.params:  # the last step's reduced values: overwritten, never zeroed first
        k, _, off = sh._where[id(p)]
        sh.buckets[k].grads[off : off + p.numel()].fill_(float("nan"))  # type: ignore[index]
    sh.begin_step()
    x = torch.randn(3, rw.HID)
    for _ in range(2):  # two micro-batches; only the stage's first layer gets gradients
        module[0](x).sum().backward()
        ref[0](x).sum().backward()
        sums = sh.grad_sums()
    used = {id(p) for p in module[0].parameters()}
    for p, q in zip(module.parameters(), ref.parameters(), strict=True):
        k, _, off = sh._where[id(p)]
        grads = sh.buckets[k].grads
        assert grads is not None
        view = grads[off : off + p.numel()].view_as(p)
        if id(p) in used:
            assert p.grad is not None and p.grad.data_ptr() == view.data_ptr()
            assert torch.allclose(view, q.grad)
        else:
            assert p.grad is None and not view.any()
    assert all(torch.isfinite(t) for t in sums)
    sh.close()


class _Work:
    def __init__(self, log: list[int], k: int) -> None:
        self.log, self.k = log, k

    def wait(self) -> None:
        self.log.append(self.k)


def test_a_layer_waits_for_its_own_gathered_buckets_when_it_next_runs() -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 1], global_batch_size=12, num_micro_batches=2, replicas=[1, 2])
    module = wl.build_stage(1, 4, 0)
    sh = FlatShards(plan, 1, 0, module, flat_parameters(plan, wl, 1, module), None, 1,
                    bucket_bytes=100)  # fmt: skip
    waited: list[int] = []
    sh._gathers = {k: [_Work(waited, k)] for k in range(len(sh.buckets))}
    of_layer = [sorted({sh._where[id(p)][0] for p in layer.parameters()}) for layer in module]
    assert len(of_layer[0]) and of_layer[0] != of_layer[-1]
    module[0](torch.randn(2, rw.HID))
    assert waited == of_layer[0]  # the first layer's buckets only, before it computes
    module[0](torch.randn(2, rw.HID))
    assert waited == of_layer[0]  # nothing left to wait for
    sh.close()  # waits for the rest
    assert sorted(waited) == list(range(len(sh.buckets)))


def test_tied_parameters_keep_whole_gradients_and_shard_their_state_in_slices() -> None:
    wl = rw.tied_mlp()
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[3, 1])
    hits: torch.Tensor | None = None
    for j in range(3):
        module = wl.build_stage(0, 2, 0)
        flat = flat_parameters(plan, wl, 0, module)
        tied = tied_parameters(plan, wl, 0, module)
        weight = dict(enumerate(module.children()))[1].get_parameter("0.weight")
        assert [id(t) for t in tied] == [id(weight)]  # layer 1's copy (layer 2's: stage 1)
        assert id(weight) not in {id(p) for p in flat}
        assert len(flat) == len(list(module.parameters())) - 1
        sh = FlatShards(plan, 0, j, module, flat, None, 1, tied=tied)
        (piece,) = [pc for pc in sh.pieces if pc.origin is weight]
        assert piece.param.data_ptr() == weight.reshape(-1)[piece.offset :].data_ptr()
        hits = torch.zeros(weight.numel()) if hits is None else hits
        hits[piece.offset : piece.offset + piece.param.numel()] += 1
        # its gradient is the slice of the whole (summed) one, pointed at the update
        weight.grad = torch.arange(weight.numel(), dtype=torch.float32).view_as(weight)
        sh.point_tied()
        assert piece.param.grad is not None
        assert torch.equal(
            piece.param.grad, weight.grad.reshape(-1)[piece.offset :][: piece.param.numel()]
        )
        # the norm counts each piece of what replica 0 counts whole, once over the replicas
        assert [id(p) for p in sh.counted([weight])] == [id(piece.param)]
        # the next step lets the whole gradient go: the piece no longer holds a view of it
        sh.begin_step()
        assert piece.param.grad is None
        sh.close()
    assert hits is not None and torch.equal(hits, torch.ones_like(hits))
    assert unsharded_stages(plan) == [1]


# -- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "message"), [(4, "got 4"), (-1, "got -1")])
def test_bad_zero_stage_is_named(value: int, message: str) -> None:
    with pytest.raises(ValidationError, match="zero_stage must be one of 0, 1, 2, 3") as e:
        TrainConfig(zero_stage=value)
    assert message in str(e.value)


def test_zero_stage_is_an_optimisation_option_verify_forwards() -> None:
    assert "zero_stage" in OPTIM_FIELDS and ZERO_STAGES == (0, 1, 2, 3)
    assert TrainConfig().zero_stage == 0


@pytest.mark.parametrize("cmd", ["train", "verify"])
def test_cli_zero_stage_flag_reaches_the_train_config(cmd: str) -> None:
    from dapple.cli import build_parser
    from dapple.cli._train_flags import run_config_of, verify_config_of

    def train_config(*flags: str) -> TrainConfig:
        args = build_parser().parse_args([cmd, "--plan", "p.json", "--model", "mlp", *flags])
        return (run_config_of if cmd == "train" else verify_config_of)(args).train

    for z in (1, 2):
        assert train_config("--zero-stage", str(z)).zero_stage == z
    assert train_config().zero_stage == 0


def test_cli_bad_zero_stage_is_one_line_before_any_compute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[2, 2])
    plan.save(tmp_path / "plan.json")
    ck = tmp_path / "ck"
    args = ["--plan", str(tmp_path / "plan.json"), "--model", "runtime_workloads:mlp"]
    saving = ["--checkpoint-dir", str(ck), "--save-every", "1"]
    for cmd, bad in itertools.product(("train", "verify"), ("4", "x", "-1")):
        assert main([cmd, *args, "--zero-stage", bad, *(saving if cmd == "train" else [])]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dapple: error:"), err
        assert f"--zero-stage must be one of 0, 1, 2, 3, got {bad!r}" in err[0], err
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
def test_verify_zero1_and_zero2_under_1_3_2_2_1_2_1_and_dp4() -> None:
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
    # ZeRO-2 in the same launch: the plans' own zero stage (the larger of it and the run's)
    zero2 = [
        dataclasses.replace(p, stages=tuple(dataclasses.replace(st, zero_stage=2) for st in p.stages))
        for p in plans
    ]  # fmt: skip
    cases = [(p, wl) for p in plans] + [(plans[1], tied)] + [(p, wl) for p in zero2]
    cases += [(zero2[1], tied)]
    steps = 3
    reports = api.verify_many(cases, steps, device="cpu", clip_grad_norm=CLIP, zero_stage=1,
                              **OPTS)  # fmt: skip
    assert [max(s.zero_stage for s in r.plan.stages) for r in reports] == [0] * 5 + [2] * 5
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


def _crashed_past_cut(ck: str, rank: int) -> None:
    """The run's last save (step STEPS) removed by rank 0: ``ck`` as after a crash past CUT."""
    import shutil

    import torch.distributed as dist

    from dapple.runtime.checkpoint import step_dir

    if rank == 0:
        shutil.rmtree(step_dir(ck, STEPS))
    dist.barrier()


def resume_worker(rank: int, world: int, out_dir: str) -> None:
    """2:2 ZeRO-1 straight vs saved at CUT and resumed (2:2 ZeRO-1; 1:3 unsharded and ZeRO-1)."""
    from dapple.runtime import init_distributed, run_plan, shutdown_distributed
    from dapple.runtime.checkpoint import latest_checkpoint, load_layer_states

    device = init_distributed(TrainConfig(timeout_s=60), world)
    wl = rw.mlp()
    p22 = straight_plan(4, [0, 2], global_batch_size=6, num_micro_batches=2, replicas=[2, 2])
    p13 = straight_plan(4, [0, 1], global_batch_size=6, num_micro_batches=2, replicas=[1, 3])
    ck = str(Path(out_dir, "ck"))

    def run(plan, workload=wl, **kw: object):  # type: ignore[no-untyped-def]
        cfg = TrainConfig(**{**RESUME, "steps": STEPS, **kw})  # type: ignore[arg-type]
        return run_plan(plan, workload, cfg, device=device)

    full = run(p22, zero_stage=1)
    # the same sharding asked for per stage in the plan (run-wide zero_stage 0)
    p22z = dataclasses.replace(
        p22, stages=tuple(dataclasses.replace(st, zero_stage=1) for st in p22.stages)
    )
    planned = run(p22z)
    run(p22, zero_stage=1, checkpoint_dir=ck, save_every=CUT)  # saves at CUT and STEPS
    _crashed_past_cut(ck, rank)
    again = run(p22, zero_stage=1, checkpoint_dir=ck, resume=True)
    other = run(p13, checkpoint_dir=ck, resume=True)  # another plan, unsharded
    other1 = run(p13, zero_stage=1, checkpoint_dir=ck, resume=True)  # ... and re-sharded by 3
    # ZeRO-2: straight; resumed from the ZeRO-1 checkpoint; saved under 1:3 ZeRO-2 and
    # resumed under 2:2 unsharded
    z2 = run(p22, zero_stage=2)
    z2_again = run(p22, zero_stage=2, checkpoint_dir=ck, resume=True)
    # the reduce_scatter_single / all_gather_single path (NCCL's), here on gloo
    from dapple.runtime.parallel.zero import TENSOR_COLLECTIVES_ENV

    os.environ[TENSOR_COLLECTIVES_ENV] = "1"
    tensor_path = [run(p13, zero_stage=z) for z in (1, 2)]
    os.environ.pop(TENSOR_COLLECTIVES_ENV)
    plain13 = run(p13)
    ck2 = str(Path(out_dir, "ck2"))
    run(p13, zero_stage=2, checkpoint_dir=ck2, save_every=CUT)
    _crashed_past_cut(ck2, rank)
    from_z2 = run(p22, checkpoint_dir=ck2, resume=True)
    # a tied weight across the two replicated stages, its state sharded in slices: saved under
    # ZeRO-1, resumed unsharded (and the other way) equals the unsharded run
    tied, ck3, ck4 = rw.tied_mlp(), str(Path(out_dir, "ck3")), str(Path(out_dir, "ck4"))
    tied_plain = run(p22, tied)
    run(p22, tied, zero_stage=1, checkpoint_dir=ck3, save_every=CUT)
    _crashed_past_cut(ck3, rank)
    tied_from_z1 = run(p22, tied, checkpoint_dir=ck3, resume=True)
    run(p22, tied, checkpoint_dir=ck4, save_every=CUT)
    _crashed_past_cut(ck4, rank)
    tied_to_z2 = run(p22, tied, zero_stage=2, checkpoint_dir=ck4, resume=True)
    # a non-finite loss with on_nonfinite=skip: no replica updates its shard or gathers
    nan_wl = dataclasses.replace(wl, make_batch=_nan_batch)
    skips = [
        run_plan(p22, nan_wl, TrainConfig(**{**RESUME, "steps": 3, "on_nonfinite": "skip",
                                             "zero_stage": z}), device=device)  # type: ignore[arg-type]
        for z in (0, 1, 2)
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
        # ZeRO-1 changes who updates an element, not the update: stage 0's to rounding (the
        # reduce-scatter and the shards' norms sum in another order than the AllReduce)
        "other_same_sharded": _close(other.module, other1.module),
        "skip_same": _close(skips[0].module, skips[1].module)
        and all(torch.isfinite(p).all() for p in skips[1].module.parameters()),
        "skip_same2": _close(skips[0].module, skips[2].module),
        "zero2_same": _close(full.module, z2.module)
        and _close(full.module, z2_again.module)
        and _close(full.module, from_z2.module),
        "zero2_owned": _owned(z2.optimizer),
        "tied_same": _close(tied_plain.module, tied_from_z1.module)
        and _close(tied_plain.module, tied_to_z2.module),
        "tensor_path_same": all(_close(plain13.module, t.module) for t in tensor_path),
        "skip_lrs": [m.lr for m in skips[1].metrics],
        "other1_owned": _owned(other1.optimizer),
        "other_params": sum(p.numel() for p in other.module.parameters()),
        "stage_params": sum(p.numel() for p in full.module.parameters()),
        "planned_same": all(
            torch.equal(a, b)
            for a, b in zip(full.module.parameters(), planned.module.parameters(), strict=True)
        ),
        "planned_owned": _owned(planned.optimizer),
        "owned": _owned(opt),
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


def _owned(opt: torch.optim.Optimizer | None) -> int:
    """Parameter elements with state in ``opt`` (this replica's shard)."""
    return sum(p.numel() for p in opt.state) if opt is not None else 0  # type: ignore[attr-defined]


def _close(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every parameter of ``a`` equals ``b``'s to float32 rounding (1e-6)."""
    return all(
        torch.allclose(x, y, rtol=1e-6, atol=1e-6)
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


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
        assert row["skip_same2"], f"rank {r}: a skipped step differs under ZeRO-2"
        assert row["zero2_same"], f"rank {r}: ZeRO-2 (straight or resumed) differs"
        assert row["zero2_owned"] == row["owned"], r
        assert row["tied_same"], f"rank {r}: the tied weight's sharded state resumed differently"
        assert row["tensor_path_same"], f"rank {r}: reduce_scatter/all_gather path differs"
        assert row["planned_same"] and row["planned_owned"] == row["owned"], r
    assert rows[0]["skip_lrs"][NAN_STEP] is None  # the step was skipped (no update)
    assert rows[0]["skip_lrs"][NAN_STEP + 1] is not None
    # 1:3 with ZeRO-1: stage 0 (one replica) keeps everything, stage 1 is sharded by 3
    assert rows[0]["other1_owned"] == rows[0]["other_params"]
    owned13 = [rows[r]["other1_owned"] for r in (1, 2, 3)]
    assert sum(owned13) == rows[1]["other_params"]  # the shards cover the stage once
    assert max(owned13) - min(owned13) < 3, owned13  # equal chunks, but for the padding
    # each replica's optimizer holds state for its shard only; the shards cover the stage
    for stage_ranks in ([0, 1], [2, 3]):
        owned = [rows[r]["owned"] for r in stage_ranks]
        assert sum(owned) == rows[stage_ranks[0]]["stage_params"]
        assert max(owned) - min(owned) < 2, owned
    # resumed under 1:3 without sharding: the same weights as the 2:2 ZeRO-1 run, to rounding
    full = {k: v for row in rows for k, v in row["full"].items()}
    for row in rows:
        for k, tensors in row["other"].items():
            for a, b in zip(tensors, full[k], strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


# -- the planner's memory and cost model (pure) --------------------------------------------------
def test_state_bytes_per_parameter_byte_under_each_zero_stage() -> None:
    from builders import make_profile
    from dapple.cost.memory import state_bytes_per_parameter_byte

    adam = make_profile()  # factor 3: gradient + two moments
    assert state_bytes_per_parameter_byte(adam) == 4.0
    for z in (1, 2):
        assert (
            state_bytes_per_parameter_byte(adam, Parallelism(zero_stage=z)) == 4.0
        )  # one replica: no-op
    assert (
        state_bytes_per_parameter_byte(adam, Parallelism(replicas=4)) == 5.0
    )  # + the AllReduce buckets
    # ZeRO-1: parameters 1 + gradients (in the buckets) 1 + (gradient shard + moments) 3/4
    assert state_bytes_per_parameter_byte(adam, Parallelism(replicas=4, zero_stage=1)) == 2.75
    assert state_bytes_per_parameter_byte(adam, Parallelism(replicas=2, zero_stage=1)) == 3.5
    # ZeRO-2: parameters 1 + (gradient shard + moments) 3/4
    assert state_bytes_per_parameter_byte(adam, Parallelism(replicas=4, zero_stage=2)) == 1.75
    sgd = dataclasses.replace(adam, optimizer_state_factor=1.0)  # no moments
    assert state_bytes_per_parameter_byte(sgd, Parallelism(replicas=4, zero_stage=1)) == 2.25
    assert state_bytes_per_parameter_byte(sgd, Parallelism(replicas=4, zero_stage=2)) == 1.25


def test_plan_memory_and_sync_cost_under_zero1_and_zero2() -> None:
    from builders import make_cluster, make_profile
    from dapple.cost.comm import allreduce_ms, stage_sync_ms
    from dapple.cost.memory import zero_saved_bytes
    from dapple.cost.pipeline import pipeline_latency

    profile, cluster = make_profile(params=10**6), make_cluster()
    M = 4
    plan = straight_plan(6, [0, 3], global_batch_size=12, num_micro_batches=M, replicas=[1, 3])
    z0, z1, z2 = (
        [r for r in pipeline_latency(plan, profile, cluster, zero_stage=z).stages if r.kind == "compute"]
        for z in (0, 1, 2)
    )  # fmt: skip
    assert z1[0].memory_bytes == z0[0].memory_bytes == z2[0].memory_bytes  # one replica
    assert zero_saved_bytes(profile, (0, 3), Parallelism(zero_stage=1)) == 0.0
    saved1 = zero_saved_bytes(profile, (3, 6), Parallelism(replicas=3, zero_stage=1))
    assert saved1 == pytest.approx(3 * 10**6 * (5 - 3))  # 5 -> 1 + 1 + 3/3 bytes per byte
    # ZeRO-2: 5 -> 1 + 3/3; in flight the stage's one bucket of gradients beside its staging
    # copy (zero2_in_flight_bytes, 2 x 3 MB) in place of one layer's fresh gradient (1 MB)
    assert zero_saved_bytes(
        profile, (3, 6), Parallelism(replicas=3, zero_stage=2)
    ) == pytest.approx(3 * 10**6 * (5 - 2) + 10**6 - 2 * 3 * 10**6)
    # the phases shift by 2 kB: unsharded, the peak is the first layer's backward with its
    # 1 MB weight gradient in flight; under ZeRO-1 that gradient is in the state, and the peak
    # moment is the loss's (log-softmax and its two gradients, 3 kB) over the layers' 1 kB
    assert z0[1].memory_bytes - z1[1].memory_bytes == pytest.approx(saved1 - 2 * 10**3)
    # ZeRO-1: reduce-scatter + all-gather = the AllReduce's bytes; ZeRO-2: M reduce-scatters
    assert z1[1].allreduce_ms == pytest.approx(z0[1].allreduce_ms) and z0[1].allreduce_ms > 0
    assert z2[1].allreduce_ms == pytest.approx((M + 1) / 2 * z0[1].allreduce_ms)
    assert stage_sync_ms(cluster, 1e6, [0], M) == 0.0
    assert stage_sync_ms(cluster, 1e6, [0, 1]) == allreduce_ms(cluster, 1e6, [0, 1])
    zero2 = Parallelism(replicas=2, zero_stage=2).gradient_reductions(M)
    assert stage_sync_ms(cluster, 1e6, [0, 1], zero2) == (M + 1) / 2 * allreduce_ms(
        cluster, 1e6, [0, 1]
    )
    # the simulator's AR of a stage planned with ZeRO-2 lasts what the planner counts
    from dapple.simulate import simulate

    def sim_ar(z: int) -> float:
        stages = (plan.stages[0], dataclasses.replace(plan.stages[1], zero_stage=z))
        events = simulate(dataclasses.replace(plan, stages=stages), profile, cluster).events
        # each replica's AR event runs from its arrival; the last to arrive waits only for it
        return min(e.duration_ms for e in events if e.action.kind.name == "ALLREDUCE")

    assert sim_ar(0) == pytest.approx(z0[1].allreduce_ms, rel=1e-6)
    assert sim_ar(2) == pytest.approx(z2[1].allreduce_ms, rel=1e-6)


def test_simulated_device_memory_counts_each_stages_zero_stage() -> None:
    """The simulator's peak per device is the planner's: ZeRO-1 saves its bytes on the
    replicated stage only, and an interleaved device holds ZeRO-2's gradients in flight once
    (one backward at a time), not once per chunk."""
    from builders import make_cluster, make_profile
    from dapple.cost.memory import (
        device_state_bytes,
        gradients_in_flight_bytes,
        zero2_in_flight_bytes,
        zero_saved_bytes,
    )
    from dapple.cost.pipeline import pipeline_latency
    from dapple.simulate import simulate

    profile, cluster = make_profile(params=10**6), make_cluster()
    plan = straight_plan(6, [0, 3], global_batch_size=12, num_micro_batches=4, replicas=[1, 3])

    def static(p: Plan) -> dict[int, float]:
        return {d.device: d.static_memory_bytes for d in simulate(p, profile, cluster).devices}

    def peaks(p: Plan) -> dict[int, float]:
        return {d.device: d.peak_memory_bytes for d in simulate(p, profile, cluster).devices}

    def planned(p: Plan) -> list[float]:
        rows = pipeline_latency(p, profile, cluster).stages
        return [r.memory_bytes for r in rows if r.kind == "compute"]

    base, z1 = peaks(plan), peaks(_with_zero(plan, 1))
    assert base[0] == z1[0]  # one replica: nothing to shard
    for p, got in ((plan, base), (_with_zero(plan, 1), z1)):  # the planner's peaks
        want = planned(p)
        assert [got[d] for d in (0, 1, 2, 3)] == pytest.approx([want[0], *[want[1]] * 3])
    for dev in (1, 2, 3):  # less the 2 kB phase shift of test_plan_memory_and_sync_cost_...
        saved = zero_saved_bytes(profile, (3, 6), Parallelism(replicas=3, zero_stage=1)) - 2 * 10**3
        assert base[dev] - z1[dev] == pytest.approx(saved)
    inter = interleave(
        straight_plan(6, [0, 3], global_batch_size=12, num_micro_batches=4, replicas=[2, 2]), 3
    )
    mine = [inter.stages[k] for k in inter.stages_of_device(0)]
    z2 = [dataclasses.replace(st, zero_stage=2) for st in mine]
    once = gradients_in_flight_bytes(profile, z2[0].layers, z2[0].parallel)
    chunk_bytes = sum(x.parameter_bytes for x in profile.layers[slice(*z2[0].layers)])
    assert len(z2) == 3 and once == 2 * chunk_bytes  # one bucket beside its staging copy
    assert once == zero2_in_flight_bytes(profile, z2[0].layers, z2[0].parallel)
    per_chunk = sum(device_state_bytes(profile, [st]) for st in z2)
    assert device_state_bytes(profile, z2) == pytest.approx(per_chunk - 2 * once)
    assert static(_with_zero(inter, 2))[0] == pytest.approx(device_state_bytes(profile, z2))


def _with_zero(plan: Plan, zero: int) -> Plan:
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, zero_stage=zero if st.replicas > 1 else 0) for st in plan.stages
    ))  # fmt: skip


def test_search_finds_data_parallel_only_with_sharded_state() -> None:
    """One stage of 6 x 100 MB of Adam parameters needs 2.4 GB on one device, 3.0 GB per
    replica of DP x4 (the AllReduce buckets), 2.1 GB under ZeRO-1 with 2 replicas and 1.65 GB
    with 4: on 2.15 GB devices only sharded data parallelism fits."""
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
    from dapple.cost.pipeline import pipeline_latency

    plan = straight_plan(6, [0, 3], global_batch_size=8, num_micro_batches=2, replicas=[1, 3])
    assert all("zero_stage" not in st for st in plan.to_dict()["stages"])  # 0: left out
    sharded = dataclasses.replace(
        plan, stages=(plan.stages[0], dataclasses.replace(plan.stages[1], zero_stage=1))
    )
    d = sharded.to_dict()
    assert [st.get("zero_stage") for st in d["stages"]] == [None, 1]
    assert Plan.from_dict(d) == sharded
    bad = json.loads(json.dumps(d))
    bad["stages"][1]["zero_stage"] = 4  # 3 is ZeRO-3 (tests/test_tensor_plan.py)
    with pytest.raises(
        ValidationError, match=r"plan stage 1: .*zero_stage must be 0, 1, 2 or 3, got 4"
    ):
        Plan.from_dict(bad)
    # the cost model follows the stage's own choice
    profile, cluster = make_profile(params=10**6), make_cluster()
    own = pipeline_latency(sharded, profile, cluster)
    run_wide = pipeline_latency(plan, profile, cluster, zero_stage=1)
    assert [r.memory_bytes for r in own.stages] == [r.memory_bytes for r in run_wide.stages]
    assert own.L_ms == run_wide.L_ms


def test_cli_plan_prints_the_zero_choice_and_rejects_unknown_stages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "--planner", "dp"]
    assert main([*base]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "stage 0 (r=16) zero stage 0, sharding would save" in out
    for bad in ("4", "x", "-1"):
        assert main([*base, "--zero-stage", bad]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert (
            err[0] == f"dapple: error: --zero-stage must be one of 0, 1, 2, 3 or auto, got {bad!r}"
        )


def test_cli_plan_records_the_zero_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a"]
    for z in (1, 2):
        assert main([*base, "--zero-stage", str(z), "-o", str(tmp_path / "p.json")]) == 0
        out = " ".join(capsys.readouterr().out.split())
        plan = Plan.load(tmp_path / "p.json")
        assert any(st.replicas > 1 for st in plan.stages)
        assert all(st.zero_stage == (z if st.replicas > 1 else 0) for st in plan.stages)
        assert f"zero stage {z}, saves" in out


def test_auto_shards_only_where_memory_asks() -> None:
    from builders import make_cluster, make_profile
    from dapple.planner.search import dapple_search

    profile = make_profile(params=10**8, act=10.0)
    tight = dataclasses.replace(make_cluster(), device_memory_bytes=int(2.15e9))
    plan = dapple_search(profile, tight, 8, max_stages=1, zero_stage="auto")
    assert plan.replication == "4" and plan.stages[0].zero_stage == 1  # as zero_stage=1
    roomy = make_cluster()  # 16 GiB: nothing asks for sharding
    auto = dapple_search(profile, roomy, 8, zero_stage="auto")
    assert auto == dapple_search(profile, roomy, 8)
    assert all(st.zero_stage == 0 for st in auto.stages)


def test_auto_weighs_zero2_traffic_against_recomputation() -> None:
    from dapple.planner.stage_options import StageOption, pick_zero_mode
    from dapple.planner.zero_modes import ZeroMode

    def opt(z: Any, f: float, ar: float, d_nr: int, d_r: int) -> tuple[ZeroMode, StageOption]:
        none: Any = None  # the stage terms: not read by the choice
        return (ZeroMode(z), StageOption(f, 2 * f, ar, d_nr, d_r, none, none))

    # k = 4 in flight, M = 4: 0 and 1 hold 4 only re-computing (AR + M F), 2 without (its AR is
    # (M + 1) / 2 = 2.5 x the AllReduce)
    for f, want in ((1.0, 2), (0.1, 0)):
        options = [opt(0, f, 1.0, 1, 5), opt(1, f, 1.0, 2, 6), opt(2, f, 2.5, 4, 8)]
        assert pick_zero_mode(options, 4, 4)[0] == ZeroMode(want), f
    # ZeRO-1 holds k without re-computation at the AllReduce's cost: preferred to ZeRO-2
    options = [opt(0, 1.0, 1.0, 1, 5), opt(1, 1.0, 1.0, 4, 6), opt(2, 1.0, 2.5, 4, 8)]
    assert pick_zero_mode(options, 4, 4)[0] == ZeroMode(1)
    # nothing holds k: the most room
    assert pick_zero_mode([opt(0, 1.0, 1.0, 0, 1), opt(2, 1.0, 2.5, 1, 2)], 4, 4)[0] == ZeroMode(2)


def test_search_finds_plans_only_zero2_fits() -> None:
    """6 x 100 MB of Adam parameters in one stage: 1.65 GB + 100 MB in flight per replica of
    DP x4 under ZeRO-1, 1.05 GB + 4.5 x 100 MB in flight under ZeRO-2 (a 100 MB bucket's
    gradients and staging copy, and the two buckets before it being reduced, each a copy and
    its 1/4 output) - on 1.6 GB devices only ZeRO-2 fits; ``auto`` finds it."""
    from builders import make_cluster, make_profile
    from dapple.errors import InfeasibleError
    from dapple.planner.search import dapple_search

    profile = make_profile(params=10**8, act=10.0)
    cluster = dataclasses.replace(make_cluster(), device_memory_bytes=int(1.6e9))
    with pytest.raises(InfeasibleError):
        dapple_search(profile, cluster, 8, max_stages=1, zero_stage=1)
    for z in (2, "auto"):
        plan = dapple_search(profile, cluster, 8, max_stages=1, zero_stage=z)
        assert plan.stages[0].replicas > 1 and plan.stages[0].zero_stage == 2, z


# -- bad input ------------------------------------------------------------------------------------
def _adam_checkpoint(root: Path, plan: Plan, *, cut: tuple[int, str] | None = None,
                     drop: tuple[int, str] | None = None) -> None:  # fmt: skip
    """A one-step Adam checkpoint of the 4-layer test MLP, written as a run writes it, with the
    moments of parameter ``cut`` halved (a missing shard) or the state of ``drop`` left out."""
    from dapple.runtime.checkpoint import CheckpointMeta, save_checkpoint, stage_layer_states

    wl = rw.mlp()
    states = stage_layer_states(wl.build_stage(0, 4, 0), 0)
    for i, ls in states.items():
        for name, t in ls.tensors.items():
            st = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(t),
                  "exp_avg_sq": torch.zeros_like(t)}  # fmt: skip
            if (i, name) == cut:
                st = {**st, "exp_avg": st["exp_avg"].reshape(-1)[: t.numel() // 2]}
            if (i, name) != drop:
                ls.optimizer[name] = st
    meta = CheckpointMeta(model_name=wl.name, num_layers=4, step=1, samples_consumed=4,
                          plan=plan.to_dict(), optimizer_type="Adam", world_size=4)  # fmt: skip
    save_checkpoint(root, meta, states)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_resume_with_an_incomplete_shard_is_one_line_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[2, 2])
    plan.save(tmp_path / "plan.json")
    ck = tmp_path / "ck"
    _adam_checkpoint(ck, plan, cut=(1, "0.weight"))
    before = _files(ck)
    args = ["train", "--plan", str(tmp_path / "plan.json"), "--model", "runtime_workloads:mlp",
            "--optimizer", "adam", "--steps", "3", "--checkpoint-dir", str(ck), "--resume",
            "--save-every", "1"]  # fmt: skip
    for z in ("0", "1", "2"):
        assert main([*args, "--zero-stage", z]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dapple: error: checkpoint"), err
        assert "is incomplete: layer 1 parameter '0.weight': optimizer state 'exp_avg'" in err[0]
        assert _files(ck) == before  # nothing saved is touched


def test_restore_names_a_parameter_without_optimizer_state(tmp_path: Path) -> None:
    from dapple.runtime.checkpoint import CheckpointError, latest_checkpoint, restore_stage

    plan = straight_plan(4, [0], global_batch_size=4, num_micro_batches=2, replicas=[2])
    _adam_checkpoint(tmp_path, plan, drop=(2, "0.bias"))
    ck = latest_checkpoint(tmp_path)
    assert ck is not None
    module = rw.mlp().build_stage(0, 4, 0)
    opt = torch.optim.Adam(module.parameters())
    with pytest.raises(CheckpointError, match=r"incomplete: layer 2 parameter '0.bias' has no"):
        restore_stage(ck, module, 0, opt)


def test_zero_stage_on_single_replica_stages_is_a_no_op_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from dapple.runtime.parallel.zero import zero_stage_of

    plan = straight_plan(4, [0, 1, 3], global_batch_size=4, num_micro_batches=2, replicas=[1, 2, 1])
    for z in (1, 2):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dapple.runtime.parallel.zero.select"):
            got = [zero_stage_of(plan, TrainConfig(zero_stage=z), rank, plan.stage_of_device(rank)[0])
                   for rank in plan.devices]  # fmt: skip
        assert got == [0, z, z, 0]
        said = [r.getMessage() for r in caplog.records]
        assert said == [
            f"zero stage {z} is a no-op on stage(s) 0, 2: one replica each (plan 1:2:1)"
        ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="dapple.runtime.parallel.zero.select"):
        assert zero_stage_of(plan, TrainConfig(), 0, 0) == 0
    assert not caplog.records
