"""Optimizers, lr schedules and global gradient-norm clipping (:mod:`dapple.runtime.optim`).

Pure tiers first (``lr_at`` golden values and properties, the parameter-group rule, which
parameters each rank counts in the global norm, option checks, the one-process reference
against hand-written torch), then multi-process runs (marked slow): ``verify`` under 3:1, 1:2:1
and 2:2 with AdamW + cosine + warm-up + a binding clip, GPT-2 with its tied embedding split
across stages, a deliberate miscount that ``verify`` must catch, and an exact resume of SGD
momentum + cosine from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import runtime_workloads as rw
from dapple import api
from dapple.cli import main
from dapple.cli._optim_args import LR_SCHEDULE_NAMES
from dapple.core.plan import Plan, straight_plan
from dapple.errors import ValidationError
from dapple.runtime.longrun import OPTIMIZER_CLASSES
from dapple.runtime.optim import (
    COUNT_EVERY_REPLICA_ENV,
    counted_parameters,
    decays,
    lr_at,
    make_optimizer,
    param_groups,
)
from dapple.runtime.train_config import (
    LR_SCHEDULES,
    OPTIMIZER_STATE_FACTOR,
    OPTIMIZERS,
    TrainConfig,
    state_factor,
)
from dapple.runtime.verify import reference_run

G = 6
"""Global batch of the multi-process runs (divisible by 3 replicas x 2 micro-batches)."""


# -- lr_at: golden values ---------------------------------------------------------------------
def test_lr_at_constant_with_and_without_warmup() -> None:
    assert [lr_at(t, lr=0.1, steps=5) for t in range(5)] == [0.1] * 5
    got = [lr_at(t, lr=1.0, steps=8, warmup_steps=4) for t in range(6)]
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_lr_at_cosine_golden_values() -> None:
    def f(t: int) -> float:
        return lr_at(t, lr=1.0, steps=10, schedule="cosine", warmup_steps=2, min_lr=0.1)

    # n = t + 1; warm-up n/W; then min + (lr - min) (1 + cos(pi (n - W) / (T - W))) / 2
    assert f(0) == pytest.approx(0.5)
    assert f(1) == pytest.approx(1.0)  # the peak at n = W
    assert f(5) == pytest.approx(0.1 + 0.9 * 0.5)  # n = 6: halfway through the decay
    assert f(3) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 2 / 8)))
    assert f(9) == pytest.approx(0.1)  # the last step
    assert f(12) == pytest.approx(0.1)  # past the end: stays at min_lr
    # warm-up as long as the run: no decay step; past the end min_lr (no division by T - W)
    assert lr_at(4, lr=1.0, steps=5, schedule="cosine", warmup_steps=5, min_lr=0.1) == 1.0
    assert lr_at(7, lr=1.0, steps=5, schedule="cosine", warmup_steps=5, min_lr=0.1) == 0.1
    # no warm-up: the first update already decays a little, the last ends at min_lr
    no_w = [lr_at(t, lr=2.0, steps=3, schedule="cosine") for t in range(3)]
    assert no_w == pytest.approx([1.5, 0.5, 0.0])


@settings(max_examples=200, deadline=None)
@given(
    steps=st.integers(1, 60),
    warmup=st.integers(0, 70),
    lr=st.floats(1e-5, 10.0),
    frac=st.floats(0.0, 1.0),
)
def test_lr_at_properties(steps: int, warmup: int, lr: float, frac: float) -> None:
    min_lr = frac * lr
    lrs = [
        lr_at(t, lr=lr, steps=steps, schedule="cosine", warmup_steps=warmup, min_lr=min_lr)
        for t in range(steps)
    ]
    tol = 1e-12 * lr
    w = min(warmup, steps)
    assert all(min(min_lr, x) >= 0 and x <= lr + tol for x in lrs)
    assert all(x > 0 for x in lrs[:w])  # warm-up never uses lr 0
    # warm-up: strictly rising, linear in n, the peak at n = W
    assert all(lrs[i] < lrs[i + 1] for i in range(w - 1))
    assert all(lrs[i] == pytest.approx(lr * (i + 1) / warmup) for i in range(w))
    # decay: never rising, never below min_lr, min_lr at the last step
    assert all(lrs[i + 1] <= lrs[i] + tol for i in range(w, steps - 1))
    assert all(x >= min_lr - tol for x in lrs[w:])
    if warmup < steps:
        assert lrs[-1] == pytest.approx(min_lr, abs=tol)
    # the constant schedule is the warm-up then lr
    const = [lr_at(t, lr=lr, steps=steps, warmup_steps=warmup) for t in range(steps)]
    assert const[:w] == lrs[:w] and all(x == lr for x in const[w:])


# -- parameter groups ---------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.conv = nn.Conv1d(4, 4, 3)
        self.scale = nn.Parameter(torch.ones(()))


def test_weight_decay_only_on_parameters_with_two_or_more_dims() -> None:
    net = _Net()
    decayed = {n for n, p in net.named_parameters() if decays(p)}
    assert decayed == {"emb.weight", "lin.weight", "conv.weight"}
    groups = param_groups(net.parameters(), 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert {id(p) for p in groups[0]["params"]} == {id(net.get_parameter(n)) for n in decayed}
    assert sum(len(g["params"]) for g in groups) == len(list(net.parameters()))
    # empty groups are left out
    only_bias = param_groups([net.lin.bias], 0.1)
    assert len(only_bias) == 1 and only_bias[0]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    ("name", "cls", "extra"),
    [
        ("sgd", torch.optim.SGD, {"momentum": 0.9}),
        ("adam", torch.optim.Adam, {"betas": (0.8, 0.99), "eps": 1e-6}),
        ("adamw", torch.optim.AdamW, {"betas": (0.8, 0.99), "eps": 1e-6}),
    ],
)
def test_make_optimizer_options(name: str, cls: type, extra: dict[str, object]) -> None:
    cfg = TrainConfig(optimizer=name, lr=0.3, weight_decay=0.05, **extra)  # type: ignore[arg-type]
    opt = make_optimizer(cfg, _Net().parameters())
    assert type(opt) is cls and OPTIMIZER_CLASSES[name] == cls.__name__
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    for g in opt.param_groups:
        assert g["lr"] == 0.3
        for k, v in extra.items():
            assert tuple(g[k]) == v if isinstance(v, tuple) else g[k] == v


def test_split_pieces_make_the_same_groups_as_the_original_model() -> None:
    """The rule reads shapes only: GPT-2's pieces (qualified names of the original model)
    decay exactly the original model's decaying parameters, tied copies included."""
    pytest.importorskip("transformers")
    from dapple.models.split import original_model

    wl = api.load("dapple.models.hf:gpt2", layers=1, hidden=16, heads=2, vocab=32, seq=8)
    named = original_model(wl, 0).named_parameters(remove_duplicate=False)  # lm_head = wte
    whole = {n for n, p in named if decays(p)}
    pieces = {n for layer in wl.build_model(0) for n, p in layer.named_parameters() if decays(p)}
    assert pieces == whole and "lm_head.weight" in whole and any("wte" in n for n in whole)
    assert not any(n.endswith("bias") or ".ln_" in n for n in whole)


# -- which parameters each rank counts ----------------------------------------------------------
def _stage(plan: Plan, wl: object, s: int) -> nn.Module:
    lo, hi = plan.stages[s].layers
    return wl.build_stage(lo, hi, 0)  # type: ignore[attr-defined, no-any-return]


def _counted_elements(plan: Plan, wl: object) -> int:
    n = 0
    for s, stage in enumerate(plan.stages):
        for j in range(stage.replicas):
            module = _stage(plan, wl, s)
            n += sum(p.numel() for p in counted_parameters(plan, wl, s, j, module))  # type: ignore[arg-type]
    return n


@pytest.mark.parametrize(
    ("cuts", "replicas"),
    [([0], [1]), ([0, 2], [2, 1]), ([0, 1, 2, 3], [1, 1, 1, 1]), ([0, 2], [2, 2])],
)
def test_every_parameter_of_the_model_counts_once(cuts: list[int], replicas: list[int]) -> None:
    wl = rw.tied_mlp()  # layers 1 and 2 share one HID x HID weight
    plan = straight_plan(4, cuts, global_batch_size=4, num_micro_batches=1, replicas=replicas)
    unique = sum(p.numel() for p in wl.build_model(0).parameters()) - rw.HID * rw.HID
    assert _counted_elements(plan, wl) == unique


def test_replicas_beyond_the_first_and_later_tied_copies_count_nothing() -> None:
    wl = rw.tied_mlp()
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=1, replicas=[2, 1])
    s0, s1 = _stage(plan, wl, 0), _stage(plan, wl, 1)
    assert counted_parameters(plan, wl, 0, 1, s0) == []
    assert counted_parameters(plan, wl, None, None, None) == []
    assert len(counted_parameters(plan, wl, 0, 0, s0)) == len(list(s0.parameters()))
    later = s1[0][0].weight  # layer 2's copy: the group's first copy is layer 1's
    got = counted_parameters(plan, wl, 1, 0, s1)
    assert all(p is not later for p in got) and len(got) == len(list(s1.parameters())) - 1


def test_count_every_replica_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=1, replicas=[2, 1])
    s0 = _stage(plan, wl, 0)
    monkeypatch.setenv(COUNT_EVERY_REPLICA_ENV, "1")
    assert len(counted_parameters(plan, wl, 0, 1, s0)) == len(list(s0.parameters()))


# -- options -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"clip_grad_norm": 0.0}, "clip_grad_norm must be a finite number > 0, got 0.0"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm must be a finite number > 0, got -1.0"),
        ({"clip_grad_norm": math.inf}, "clip_grad_norm must be a finite number > 0, got inf"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0, got -0.1"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
        ({"momentum": -0.5}, r"momentum must be in \[0, 1\), got -0.5"),
        ({"momentum": 0.9, "optimizer": "adamw"}, "momentum applies to the sgd optimizer only"),
        ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
        ({"eps": 0.0}, "eps must be a finite number > 0, got 0.0"),
        ({"lr_schedule": "linear"}, "lr_schedule must be one of constant, cosine, got 'linear'"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),
        ({"min_lr": -1e-3, "lr_schedule": "cosine"}, r"min_lr must be in \[0, lr=0.01\], got"),
        ({"min_lr": 0.1, "lr_schedule": "cosine"}, r"min_lr must be in \[0, lr=0.01\], got 0.1"),
        ({"min_lr": 1e-3}, "min_lr=0.001 applies to the cosine schedule only"),
        ({"optimizer": "lamb"}, "optimizer must be one of sgd, adam, adamw, got 'lamb'"),
    ],
)
def test_bad_options_are_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainConfig(**options)  # type: ignore[arg-type]


def test_names_agree_across_layers() -> None:
    assert OPTIMIZERS == ("sgd", "adam", "adamw")
    assert OPTIMIZER_STATE_FACTOR["adamw"] == OPTIMIZER_STATE_FACTOR["adam"] == 3.0
    assert set(OPTIMIZER_CLASSES) == set(OPTIMIZERS)
    assert LR_SCHEDULE_NAMES == LR_SCHEDULES
    # the planner's state factor: SGD's momentum buffer is one more parameter-sized tensor
    assert state_factor("sgd") == 1.0 and state_factor("sgd", 0.9) == 2.0
    assert state_factor("adamw") == state_factor("adam", 0.0) == 3.0


def test_cli_option_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    plan.save(tmp_path / "plan.json")
    base = ["--plan", str(tmp_path / "plan.json"), "--model", "runtime_workloads:mlp"]
    for cmd in ("train", "verify"):
        assert main([cmd, *base, "--clip-grad-norm", "0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dapple: error: --clip-grad-norm must be") and err.count("\n") == 1
        assert main([cmd, *base, "--optimizer", "adam", "--momentum", "0.9"]) == 2
        assert "momentum applies to the sgd optimizer only" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="unknown options"):
        reference_run(rw.mlp(), 4, 1, clip=1.0)


# -- the one-process reference against hand-written torch --------------------------------------
def test_reference_clips_and_schedules_like_torch_with_tied_weights_once() -> None:
    """The layer-chain reference (tied copies summed) equals one model with ONE tied parameter
    trained by AdamW (same groups), ``lr_at`` and ``clip_grad_norm_`` - so the chain counts
    the tied weight once in the norm."""
    wl = rw.tied_mlp()
    opts = dict(optimizer="adamw", lr=0.05, weight_decay=0.1, lr_schedule="cosine",
                warmup_steps=1, min_lr=0.01, clip_grad_norm=0.2)  # fmt: skip
    losses, params, kind = reference_run(wl, G, 4, seed=1, **opts)  # type: ignore[arg-type]
    assert kind == "layer chain"
    model = wl.build_model(1)
    tied = nn.Parameter(model[1][0].weight.detach().clone())
    model[1][0].weight = tied
    model[2][0].weight = tied
    cfg = TrainConfig(steps=4, seed=1, **opts)  # type: ignore[arg-type]
    opt = make_optimizer(cfg, model.parameters())
    clipped = 0
    for step in range(4):
        x, y = wl.make_batch(G, 1 + step)
        opt.zero_grad()
        loss = wl.loss_fn(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
        clipped += int(norm > 0.2)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr=0.05, steps=4, schedule="cosine", warmup_steps=1, min_lr=0.01)
        opt.step()
        assert losses[step] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert clipped == 4  # the clip bound on every step
    torch.testing.assert_close(params[0]["0.weight"], model[0][0].weight.detach())
    torch.testing.assert_close(params[2]["0.weight"], tied.detach())
    torch.testing.assert_close(params[1]["0.weight"], tied.detach())


# -- the verify report -------------------------------------------------------------------------
def test_report_compares_and_prints_grad_norms() -> None:
    from rich.console import Console

    from dapple.cli.verify_cmd import print_report
    from dapple.runtime.verify import StageDiff, VerifyReport

    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    stage = StageDiff(0, (0, 4), 1, 10, 0.0, 0.0, True)
    rep = VerifyReport(plan, "m", "layer chain", (stage,), (2.0, 1.5), (2.0, 1.5),
                       grad_norms=(0.75, 0.5), reference_grad_norms=(0.75, 0.50002))  # fmt: skip
    assert rep.grad_norms_ok and rep.ok  # 4e-5 relative: within GRAD_NORM_RTOL
    off = dataclasses.replace(rep, grad_norms=(0.75, 0.5 * math.sqrt(2)))
    assert not off.grad_norms_ok and not off.ok  # the weights alone would pass
    assert not dataclasses.replace(rep, grad_norms=(0.75,)).ok  # a step without a norm
    con = Console(record=True, width=140)
    print_report(con, off)
    text = con.export_text()
    assert "0.7071068" in text and "0.50002" in text  # norms side by side
    assert "gradient norms differ" in text and "MISMATCH" in text
    con = Console(record=True, width=140)
    print_report(con, rep)
    assert "OK" in con.export_text() and "differ" not in con.export_text()


# -- multi-process ------------------------------------------------------------------------------
OPTS = dict(optimizer="adamw", lr=0.02, weight_decay=0.1, lr_schedule="cosine",
            warmup_steps=2, min_lr=0.002)  # fmt: skip
CLIP = 0.05
"""Below every step's global norm of the MLP runs (~0.3-1): the clip binds on every step."""


def _mlp_plans() -> list[Plan]:
    shapes = [([0, 2], [3, 1]), ([0, 1, 3], [1, 2, 1]), ([0, 2], [2, 2])]
    return [
        straight_plan(4, cuts, global_batch_size=G, num_micro_batches=2, replicas=reps)
        for cuts, reps in shapes
    ]


def _max_diff(
    a: dict[int, dict[str, torch.Tensor]], b: dict[int, dict[str, torch.Tensor]]
) -> float:
    return max(float((a[i][n] - b[i][n]).abs().max()) for i in a for n in a[i])


def test_verify_adamw_cosine_warmup_binding_clip_under_3_1_1_2_1_and_2_2() -> None:
    """In the fast tier (CI) on purpose: uneven replication, AdamW and a binding clip, each
    plan's workers against one process."""
    wl = api.load("runtime_workloads:mlp")
    steps = 4
    reports = api.verify_many(
        [(p, wl) for p in _mlp_plans()], steps, device="cpu", clip_grad_norm=CLIP, **OPTS
    )
    for rep in reports:
        what = rep.plan.replication
        assert rep.ok, (what, rep.max_abs_diff, rep.grad_norms, rep.reference_grad_norms)
        assert rep.grad_norms_ok and len(rep.grad_norms) == steps
        assert min(rep.reference_grad_norms) > 4 * CLIP, what  # the clip binds
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), what
        assert rep.options["clip_grad_norm"] == CLIP
    # the clip changed the result: the unclipped reference ends elsewhere, far beyond the
    # tolerance the distributed runs met against the clipped one
    _, clipped, _ = reference_run(wl, G, steps, clip_grad_norm=CLIP, **OPTS)  # type: ignore[arg-type]
    _, free, _ = reference_run(wl, G, steps, **OPTS)  # type: ignore[arg-type]
    assert _max_diff(clipped, free) > 100 * reports[0].atol


@pytest.mark.slow
def test_verify_gpt2_tied_embedding_split_across_stages_counts_it_once() -> None:
    """GPT-2's ``wte`` (piece 0) and LM head (piece 3) are one parameter: plans that put the
    two copies on different stages, replicated or not, report the original model's norm."""
    pytest.importorskip("transformers")
    wl = api.load("dapple.models.hf:gpt2", layers=2, hidden=32, heads=2, vocab=64, seq=16)
    plans = [
        straight_plan(4, [0, 1, 2, 3], global_batch_size=4, num_micro_batches=2),
        straight_plan(4, [0, 3], global_batch_size=4, num_micro_batches=2, replicas=[2, 2]),
    ]
    # Adam turns float32 round-off in near-zero gradients into lr-sized steps: GPT-2 (with
    # many such gradients) gets atol 1e-4 where the MLP passes at the float32 default
    reports = api.verify_many(
        [(p, wl) for p in plans], 3, device="cpu", clip_grad_norm=0.5, atol=1e-4, **OPTS
    )
    for rep in reports:
        what = rep.plan.replication
        assert rep.reference == "original model", what
        assert rep.ok, (what, rep.max_abs_diff, rep.grad_norms, rep.reference_grad_norms)
        assert min(rep.reference_grad_norms) > 0.5, what  # the clip binds
    # counting the tied weight twice would move the norm by far more than the tolerance
    from dapple.models.split import original_model

    model = original_model(wl, 0)
    x, y = wl.make_batch(4, 0)
    wl.loss_fn(model(*x) if isinstance(x, (tuple, list)) else model(x), y).backward()
    wte = model.get_parameter(next(n for n, _ in model.named_parameters() if "wte" in n))
    assert wte.grad is not None
    once = reports[0].reference_grad_norms[0]
    twice = math.sqrt(once**2 + float(wte.grad.norm()) ** 2)
    assert once == pytest.approx(float(torch.nn.utils.get_total_norm(
        [p.grad for p in model.parameters() if p.grad is not None])), rel=1e-5)  # fmt: skip
    assert abs(twice - once) > 100 * reports[0].grad_norm_rtol * once


@pytest.mark.slow
def test_verify_catches_a_norm_that_counts_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    wl = api.load("runtime_workloads:mlp")
    plan = _mlp_plans()[2]  # 2:2
    monkeypatch.setenv(COUNT_EVERY_REPLICA_ENV, "1")
    rep = api.verify(plan, wl, 2, device="cpu", **OPTS)  # no clip: only the norm is wrong
    assert all(s.ok for s in rep.stages)  # the weights still match...
    assert not rep.grad_norms_ok and not rep.ok  # ...but the reported norm does not
    for got, ref in zip(rep.grad_norms, rep.reference_grad_norms, strict=True):
        assert got == pytest.approx(math.sqrt(2) * ref, rel=1e-4)  # every gradient twice


# -- resume ----------------------------------------------------------------------------------------
RESUME = dict(optimizer="sgd", momentum=0.9, lr=0.05, lr_schedule="cosine", warmup_steps=1,
              min_lr=0.005, clip_grad_norm=0.3, seed=3, timeout_s=60)  # fmt: skip
STEPS, CUT = 5, 3


def _crashed_past_cut(ck: str, rank: int) -> None:
    """The run's last save (step STEPS) removed by rank 0: ``ck`` as after a crash past CUT."""
    import shutil

    import torch.distributed as dist

    from dapple.runtime.checkpoint import step_dir

    if rank == 0:
        shutil.rmtree(step_dir(ck, STEPS))
    dist.barrier()


def resume_worker(rank: int, world: int, out_dir: str) -> None:
    """Straight through vs saved at CUT and resumed, under 2:2, in one process group."""
    from dapple.runtime import init_distributed, run_plan, shutdown_distributed

    device = init_distributed(TrainConfig(timeout_s=60), world)
    wl = rw.mlp()
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[2, 2])
    ck = str(Path(out_dir, "ck"))

    def run(**kw: object):
        cfg = TrainConfig(**{**RESUME, **kw})  # type: ignore[arg-type]
        return run_plan(plan, wl, cfg, device=device)

    full = run(steps=STEPS)
    run(steps=STEPS, checkpoint_dir=ck, save_every=CUT)  # saves at CUT and at the end, STEPS
    _crashed_past_cut(ck, rank)
    again = run(steps=STEPS, checkpoint_dir=ck, resume=True)  # as after a crash past CUT
    assert full.module is not None and again.module is not None
    same = all(
        torch.equal(a, b)
        for a, b in zip(full.module.parameters(), again.module.parameters(), strict=True)
    )
    saved = _opt_states(plan, rank, ck)
    state: dict[str, object] = {
        "same_weights": same,
        "momentum": [isinstance(st.get("momentum_buffer"), torch.Tensor) for st in saved],
    }
    if rank == 0:
        state["full"] = [dataclasses.asdict(m) for m in full.metrics]
        state["again"] = [dataclasses.asdict(m) for m in again.metrics]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(state))
    shutdown_distributed()


def _opt_states(plan: Plan, rank: int, ck: str) -> list[dict[str, object]]:
    """The per-parameter optimizer state saved in the checkpoint for this rank's layers."""
    from dapple.runtime.checkpoint import latest_checkpoint, load_layer_states

    found = latest_checkpoint(ck)
    assert found is not None
    s, _ = plan.stage_of_device(rank)
    lo, hi = plan.stages[s].layers
    states = load_layer_states(found, range(lo, hi))
    return [st for i in range(lo, hi) for st in states[i].optimizer.values()]


@pytest.mark.slow
def test_resume_continues_schedule_and_momentum_exactly(tmp_path: Path) -> None:
    from dapple.runtime import spawn

    spawn(resume_worker, 4, str(tmp_path), timeout_s=120)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, row in enumerate(rows):
        assert row["same_weights"], f"rank {r}: resumed weights differ from the straight run"
        assert row["momentum"] and all(row["momentum"]), r  # SGD momentum buffers were saved
    full, again = rows[0]["full"], rows[0]["again"]
    assert [m["step"] for m in again] == list(range(CUT, STEPS))
    expect = [
        lr_at(t, lr=0.05, steps=STEPS, schedule="cosine", warmup_steps=1, min_lr=0.005)
        for t in range(STEPS)
    ]
    assert [m["lr"] for m in full] == expect
    assert [m["lr"] for m in again] == expect[CUT:]
    for a, b in zip(full[CUT:], again, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    assert all(m["grad_norm"] > RESUME["clip_grad_norm"] for m in full)  # the clip binds


# -- the command line ----------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_train_and_verify_take_the_optimisation_flags(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    plan.save(tmp_path / "plan.json")
    flags = ["--optimizer", "adamw", "--lr", "0.02", "--weight-decay", "0.1", "--lr-schedule",
             "cosine", "--warmup-steps", "1", "--min-lr", "0.002", "--clip-grad-norm", "0.05",
             "--steps", "3"]  # fmt: skip
    base = ["--plan", str(tmp_path / "plan.json"), "--model", "runtime_workloads:mlp", *flags]
    metrics = tmp_path / "m.jsonl"
    assert main(["train", *base, "--metrics", str(metrics)]) == 0
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    expect = [
        lr_at(t, lr=0.02, steps=3, schedule="cosine", warmup_steps=1, min_lr=0.002)
        for t in range(3)
    ]
    assert [r["lr"] for r in rows] == expect
    assert all(r["grad_norm"] > 0.05 for r in rows)  # pre-clip, and the clip binds
    capfd.readouterr()
    assert main(["verify", *base]) == 0
    out = capfd.readouterr().out
    assert "gradient norm" in out and "OK" in out and "MISMATCH" not in out
