"""``on_nonfinite="off"``: no non-finite guard, the step's rows gathered asynchronously and read a
step late (:mod:`dapple.runtime.late_rows`). Its refusals, the late rows in a world of one, and
runs equal to one device - weights, every step's loss and gradient norm - on the V schedules
whose staircase the guard's wait costs (ZB-V on 4 ranks, and on an uneven 2:1 plan)."""

from __future__ import annotations

import itertools
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import runtime_workloads as rw
from dapple import api
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.runtime import TrainConfig
from dapple.runtime.late_rows import LateRows
from dapple.simulate.plan_variants import with_schedule


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"precision": "fp16"}, "off cannot go with fp16 loss scaling"),
        ({"clip_grad_norm": 1.0}, "off cannot go with clip_grad_norm"),
    ],
)
def test_off_is_refused_where_the_update_needs_every_rank(kw: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        TrainConfig(on_nonfinite="off", **kw)
    TrainConfig(on_nonfinite="stop", **kw)  # the guard's modes take them


def test_off_is_accepted_and_a_bad_mode_still_names_stop_or_skip() -> None:
    assert TrainConfig(on_nonfinite="off", precision="bf16").on_nonfinite == "off"
    with pytest.raises(ValidationError, match=r"stop or skip.*'ignore'"):
        TrainConfig(on_nonfinite="ignore")


def test_late_rows_are_read_once_a_step_later_in_a_world_of_one() -> None:
    """Posted rows (and the summed vector) come back on the next take, once; a second post
    before the take is an error (it would drop a step's rows). A world of one reads them
    without a gather (the gather: the multi-process tests below)."""
    late = LateRows(1)
    assert late.take() is None and not late.pending
    row = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    late.post(row, torch.tensor([4.0, 5.0], dtype=torch.float64))
    row.add_(10)  # the posted row is what was posted
    with pytest.raises(RuntimeError, match="not taken"):
        late.post(row)
    got = late.take()
    assert got is not None
    rows, table, sums = got
    assert rows == [[1.0, 2.0, 3.0]] and sums == [4.0, 5.0]
    assert table.tolist() == rows
    assert late.take() is None
    late.post(torch.tensor([7.0], dtype=torch.float64))
    got = late.take()
    assert got is not None and got[0] == [[7.0]] and got[2] == []


def _verify(plans: list, wl, steps: int, on_nonfinite: str):
    from dapple.runtime.verify import verify_many

    cfg = TrainConfig(steps=steps, seed=0, optimizer="adamw", lr=1e-3, device="cpu",
                      on_nonfinite=on_nonfinite, timeout_s=300.0)  # fmt: skip
    return verify_many([(p, wl) for p in plans], cfg, progress=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_off_equals_one_device_on_zbv_straight_and_uneven() -> None:
    """GPT-2 with dropout, 3 AdamW steps, ``on_nonfinite="off"``: ZB-V over 4 ranks (8 chunks)
    and over 2 groups replicated 2:1. Every weight, and every step's loss and gradient norm
    (read a step late, the last one after the loop), equal one device's; the guarded run of the
    same plans gives the same losses."""
    wl = api.load("dapple.models.hf:gpt2", layers=6, hidden=32, heads=2, vocab=64, seq=16,
                  dropout=0.1)  # fmt: skip
    n = wl.num_layers
    assert n == 8
    M = 8
    four = straight_plan(n, [0, 2, 4, 6], global_batch_size=2 * M, num_micro_batches=M)
    uneven = straight_plan(n, [0, n // 2], global_batch_size=2 * M, num_micro_batches=M,
                           replicas=[2, 1])  # fmt: skip
    plans = [with_schedule(p, "zbv") for p in (four, uneven)]
    assert plans[0].stages_of_group(0) == (0, 7)
    steps = 3
    off = _verify(plans, wl, steps, "off")
    for plan, rep in zip(plans, off, strict=True):
        assert rep.ok, (plan.replication, rep.max_abs_diff, rep.losses, rep.reference_losses)
        assert len(rep.losses) == len(rep.grad_norms) == steps
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)
        assert rep.grad_norms == pytest.approx(rep.reference_grad_norms, rel=1e-4)
        assert len(set(rep.losses)) == steps  # the steps differ: a late row cannot pass
    guarded = _verify(plans[:1], wl, steps, "stop")[0]
    assert guarded.ok
    assert off[0].losses == pytest.approx(guarded.losses, rel=1e-6)


NAN_STEP = 1
"""The step whose batch holds a NaN (:func:`nan_chain`)."""


def _nan_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``runtime_workloads``' MLP batch; the one of step :data:`NAN_STEP` (verify's batch seed
    0 + t) holds a NaN."""
    x, y = rw._mlp_batch(n, seed)
    if seed == NAN_STEP:
        x[1, 0] = float("nan")
    return x, y


def _block(d_in: int, d_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh())


def nan_chain() -> Workload:
    """``runtime_workloads.mlp`` (4 layers, picklable for verify's workers) whose step
    :data:`NAN_STEP` batch holds a NaN: a non-finite loss."""
    dims = [rw.IN, rw.HID, rw.HID, rw.HID, rw.OUT]
    blocks = [partial(_block, a, b) for a, b in itertools.pairwise(dims)]
    return Workload("test-nan-chain", blocks, _nan_batch, F.mse_loss)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_off_applies_a_non_finite_step_and_reports_it_at_its_step(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Without the guard a NaN in step NAN_STEP's input stops nothing: the run ends, that step's
    loss (read a step late) is reported non-finite at its own step and the one before is
    finite and equal to one device's; the guarded run of the same plan stops at that step."""
    from dapple.runtime import RankFailure

    wl = nan_chain()
    plan = with_schedule(straight_plan(wl.num_layers, [0, 2], global_batch_size=8,
                                       num_micro_batches=4), "zbv")  # fmt: skip
    steps = NAN_STEP + 2
    (rep,) = _verify([plan], wl, steps, "off")
    assert len(rep.losses) == steps
    assert all(math.isfinite(x) for x in rep.losses[:NAN_STEP]), rep.losses
    assert not math.isfinite(rep.losses[NAN_STEP]), rep.losses
    assert rep.losses[:NAN_STEP] == pytest.approx(rep.reference_losses[:NAN_STEP], rel=1e-5)
    capfd.readouterr()
    with pytest.raises(RankFailure, match="workers failed"):
        _verify([plan], wl, steps, "stop")
    assert f"step {NAN_STEP}: non-finite loss" in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_off_reports_the_guarded_runs_metrics_with_evaluation_and_checkpoints(
    tmp_path: Path,
) -> None:
    """ZB-V over 2 ranks, 3 steps, an evaluation and a checkpoint after every step: without the
    guard every step's metrics (loss, gradient norm, lr, eval loss, tokens) are the guarded
    run's - each at its own step, the last one too - and the checkpoints are the same steps."""
    wl = api.load("dapple.models.hf:gpt2", layers=2, hidden=32, heads=2, vocab=64, seq=16)
    plan = with_schedule(straight_plan(wl.num_layers, [0, 2], global_batch_size=8,
                                       num_micro_batches=4), "zbv")  # fmt: skip
    got = {}
    for mode in ("stop", "off"):
        ck = tmp_path / mode
        metrics = api.train(plan, wl, 3, device="cpu", optimizer="adamw", lr=1e-3,
                            eval_every=1, eval_batches=1, checkpoint_dir=str(ck), save_every=1,
                            on_nonfinite=mode)  # fmt: skip
        got[mode] = [(m.step, m.loss, m.grad_norm, m.lr, m.eval_loss, m.tokens) for m in metrics]
        got[mode + " saved"] = sorted(p.name for p in ck.iterdir())
    assert [g[0] for g in got["off"]] == [0, 1, 2]
    assert all(g[4] is not None and g[2] is not None for g in got["off"])
    flat = {k: [x for g in got[k] for x in g] for k in ("stop", "off")}
    assert flat["off"] == pytest.approx(flat["stop"], rel=1e-6)
    assert got["off saved"] == got["stop saved"] and got["off saved"]
