"""Mixed precision: autocast runs against the one-process reference, fp16 loss scaling agreed by
every rank, bad inputs, and profiles measured in a precision.

The multi-process scenarios run in ONE group of 4 gloo workers (spawned once); fp16 runs on the
CPU through the test hook :data:`dapple.runtime.precision.CPU_FP16_ENV`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime_workloads as rw
from dapple import api
from dapple.cli import main
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.cost.memory import (
    parameter_state_bytes,
    weight_cast_bytes,
)
from dapple.cost.peak_memory import stage_peak
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.runtime import TrainConfig
from dapple.runtime.checkpoint import read_checkpoint, step_dir
from dapple.runtime.longrun import LongRun
from dapple.runtime.precision import (
    CPU_FP16_ENV,
    LossScaler,
    Precision,
    check_precision,
    tolerances_for,
)
from dapple.runtime.verify import reference_run

B, M, SEED, LR = 4, 2, 1, 0.01
G = B * M
BIG_STEP, BIG_ROW = 1, 5  # row 5 = micro-batch 1, replica 0 of a 2-replica stage (rows 4, 5)

PLANS = {
    "1:1": (((0, 2), (0,)), ((2, 4), (1,))),
    "3:1": (((0, 2), (0, 1, 2)), ((2, 4), (3,))),
    "2:2": (((0, 2), (0, 1)), ((2, 4), (2, 3))),
}


def _zero(plan: Plan, zero: int) -> Plan:
    """``plan`` with ``zero`` on its replicated stages."""
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, zero_stage=zero if st.replicas > 1 else 0) for st in plan.stages
    ))  # fmt: skip


def plan_of(name: str) -> Plan:
    return Plan(
        planner="test",
        global_batch_size=G,
        micro_batch_size=B,
        num_micro_batches=M,
        stages=tuple(StagePlan(layers=lay, devices=dev) for lay, dev in PLANS[name]),
    )


# -- workloads: an fp16 gradient overflow, a non-finite loss -----------------------------------
def _big_target_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At step BIG_STEP one target is 1e4: the loss stays finite in fp32, but its gradient
    times the loss scale 2**16 overflows fp16 on the rank holding that row only."""
    x, y = rw._mlp_batch(n, seed)
    if seed == SEED + BIG_STEP:
        y[BIG_ROW, 0] = 1e4
    return x, y


def overflow_mlp() -> Workload:
    wl = rw.mlp()
    return Workload(wl.name, wl.layer_factories, _big_target_batch, wl.loss_fn)


def _nan_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = rw._mlp_batch(n, seed)
    if seed == SEED + BIG_STEP:
        x[BIG_ROW, 0] = float("nan")
    return x, y


def nan_mlp() -> Workload:
    wl = rw.mlp()
    return Workload(wl.name, wl.layer_factories, _nan_batch, wl.loss_fn)


def _params(module: nn.Module | None) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()] if module is not None else []


def _scenario(name: str, results: dict, fn) -> None:
    try:
        results[name] = {"ok": True, **(fn() or {})}
    except Exception as e:
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}


def worker(rank: int, world: int, out_dir: str) -> None:
    """Every multi-process scenario, in one process group (ranks outside a plan idle through)."""
    from dapple.runtime import (
        infer_boundary_specs,
        init_distributed,
        run_plan,
        shutdown_distributed,
    )

    os.environ[CPU_FP16_ENV] = "1"
    device = init_distributed(TrainConfig(timeout_s=60), world)
    base = dict(seed=SEED, optimizer="adam", lr=LR, timeout_s=60)
    wl = rw.mlp()
    out = Path(out_dir)
    res: dict[str, dict] = {}

    def run(plan: Plan, w: Workload = wl, **kw):
        return run_plan(plan, w, TrainConfig(**{**base, **kw}), device=device, exact_world=False)

    p31, p22 = plan_of("3:1"), plan_of("2:2")

    def boundary_dtype():
        s = p31.stage_of_device(rank)[0] if rank in p31.devices else None
        module = wl.build_stage(*p31.stages[s].layers, SEED) if s is not None else None
        x, _ = wl.make_batch(1, SEED)
        with Precision("bf16", device).autocast():
            specs = infer_boundary_specs(p31, rank, module, x, device)
        plain = infer_boundary_specs(p31, rank, module, x, device)
        return {"bf16": str(specs[0].tensors[0].dtype), "fp32": str(plain[0].tensors[0].dtype)}

    _scenario("boundary", res, boundary_dtype)

    fp32_default = run(p31, steps=2)
    fp32 = run(p31, steps=2, precision="fp32")
    bf16 = run(p31, steps=2, precision="bf16")
    bf16_rc = run(p31, steps=2, precision="bf16", recompute="full")

    def fp32_unchanged():
        for a, b in zip(_params(fp32.module), _params(fp32_default.module), strict=True):
            assert torch.equal(a, b)
        # and still the one-process fp32 run within assert_close's float32 tolerances
        ref_losses, ref, _ = reference_run(wl, G, 2, seed=SEED, optimizer="adam", lr=LR)
        if fp32.module is not None and fp32.stage is not None:
            lo = p31.stages[fp32.stage].layers[0]
            for k, layer in enumerate(fp32.module.children()):
                for name, got in layer.named_parameters():
                    torch.testing.assert_close(got.detach(), ref[lo + k][name])
        if rank == 0:
            assert [m.loss for m in fp32.metrics] == [m.loss for m in fp32_default.metrics]
            torch.testing.assert_close(
                torch.tensor([m.loss for m in fp32.metrics]), torch.tensor(ref_losses)
            )

    def bf16_recompute():
        for a, b in zip(_params(bf16.module), _params(bf16_rc.module), strict=True):
            assert torch.equal(a, b)  # the recomputed forward runs under the same autocast
        if rank == 0:
            assert [m.loss for m in bf16.metrics] == [m.loss for m in bf16_rc.metrics]
        diff = max(
            (
                float((a - b).abs().max())
                for a, b in zip(_params(bf16.module), _params(fp32.module), strict=True)
            ),
            default=0.0,
        )
        assert all(p.dtype == torch.float32 for p in _params(bf16.module))  # fp32 master weights
        return {"diff_vs_fp32": diff}

    _scenario("fp32-unchanged", res, fp32_unchanged)
    _scenario("bf16-recompute", res, bf16_recompute)

    # fp16: step BIG_STEP overflows on rank 2 only; every rank must skip it and halve the scale
    ck = str(out / "ck")
    one = run(p22, w=overflow_mlp(), steps=1, precision="fp16")
    two = run(p22, w=overflow_mlp(), steps=2, precision="fp16", checkpoint_dir=ck, save_every=1)
    fp32_one = run(p22, w=overflow_mlp(), steps=1)

    def fp16_skip():
        for a, b in zip(_params(two.module), _params(one.module), strict=True):
            assert torch.equal(a, b), "the overflow step changed the weights"
        if rank == 0:
            losses = [m.loss for m in two.metrics]
            return {"losses": losses, "fp32_loss": fp32_one.metrics[0].loss}
        return {}

    _scenario("fp16-skip", res, fp16_skip)
    # the same under ZeRO-1 and ZeRO-2: the overflow on one replica skips every shard's update
    sharded = [run(p22, w=overflow_mlp(), steps=2, precision="fp16", zero_stage=z) for z in (1, 2)]

    def fp16_zero():
        for r in sharded:
            for a, b in zip(_params(r.module), _params(two.module), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        return {"lrs": [m.lr for m in sharded[0].metrics]} if rank == 0 else {}

    _scenario("fp16-zero", res, fp16_zero)
    resumed = run(
        p22, w=overflow_mlp(), steps=4, precision="fp16", checkpoint_dir=ck, save_every=1,
        resume=True,
    )  # fmt: skip

    def fp16_resume():
        return {"steps": [m.step for m in resumed.metrics]} if rank == 0 else {}

    _scenario("fp16-resume", res, fp16_resume)

    def fp16_nan_loss_stops():
        try:
            run(p22, w=nan_mlp(), steps=3, precision="fp16")
        except Exception as e:
            return {"error": str(e)}
        raise AssertionError("the non-finite loss did not stop the fp16 run")

    _scenario("fp16-nan-loss", res, fp16_nan_loss_stops)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    shutdown_distributed()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    from dapple.runtime import spawn

    out = tmp_path_factory.mktemp("precision")
    spawn(worker, 4, str(out), timeout_s=120)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _ok(spawned, name: str) -> list[dict]:
    rows = [rep[name] for rep in spawned[1]]
    for rank, row in enumerate(rows):
        assert row["ok"], f"rank {rank}: {row.get('error')}"
    return rows


@pytest.mark.slow
def test_boundary_buffers_take_the_autocast_dtype(spawned) -> None:
    rows = _ok(spawned, "boundary")
    assert {r["bf16"] for r in rows} == {"torch.bfloat16"}
    assert {r["fp32"] for r in rows} == {"torch.float32"}


@pytest.mark.slow
def test_fp32_precision_is_the_default_run_bit_for_bit(spawned) -> None:
    _ok(spawned, "fp32-unchanged")


@pytest.mark.slow
def test_bf16_recompute_matches_bf16_and_differs_from_fp32(spawned) -> None:
    rows = _ok(spawned, "bf16-recompute")
    assert max(r["diff_vs_fp32"] for r in rows) > 1e-6  # autocast really ran


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale(spawned) -> None:
    rows = _ok(spawned, "fp16-skip")
    losses = rows[0]["losses"]
    # the reported loss is unscaled: step 0 matches fp32 to fp16 rounding, not x 2**16
    assert losses[0] == pytest.approx(rows[0]["fp32_loss"], rel=2e-2)
    assert 1e5 < losses[1] < 1e8  # the overflow step's loss is finite and unscaled
    ck = spawned[0] / "ck"
    scales = [read_checkpoint(step_dir(ck, s)).meta.extra["loss_scaler"] for s in (1, 2)]
    assert scales == [{"scale": 2.0**16, "clean_steps": 1}, {"scale": 2.0**15, "clean_steps": 0}]


@pytest.mark.slow
def test_fp16_overflow_skips_every_shard_under_zero1_and_zero2(spawned) -> None:
    rows = _ok(spawned, "fp16-zero")
    assert rows[0]["lrs"][BIG_STEP] is None and rows[0]["lrs"][0] is not None  # skipped


@pytest.mark.slow
def test_fp16_resume_continues_with_the_saved_scale(spawned) -> None:
    rows = _ok(spawned, "fp16-resume")
    assert rows[0]["steps"] == [2, 3]
    ck = spawned[0] / "ck"
    scales = [read_checkpoint(step_dir(ck, s)).meta.extra["loss_scaler"] for s in (3, 4)]
    assert scales == [{"scale": 2.0**15, "clean_steps": 1}, {"scale": 2.0**15, "clean_steps": 2}]


@pytest.mark.slow
def test_fp16_nonfinite_loss_still_stops_the_run(spawned) -> None:
    rows = _ok(spawned, "fp16-nan-loss")
    assert all("non-finite loss" in r["error"] for r in rows), rows


@pytest.mark.slow
def test_verify_bf16_two_stage_3_1_and_sharded_within_the_stated_tolerance() -> None:
    wl = api.load("runtime_workloads:mlp")
    sharded = [_zero(plan_of("3:1"), 1), _zero(plan_of("2:2"), 2)]  # fp32 master shards
    reports = api.verify_many(
        [(plan_of("1:1"), wl), (plan_of("3:1"), wl), *((p, wl) for p in sharded)],
        3,
        device="cpu",
        precision="bf16",
        seed=SEED,
        optimizer="adam",
        lr=LR,
    )
    rtol, atol = tolerances_for("bf16")
    for rep in reports:
        # bf16 gradients at bf16's rtol; each update from the same gradients is fp32 arithmetic
        assert rep.grad_rtol == rtol and (rep.rtol, rep.atol) == tolerances_for("fp32")
        assert rep.options["precision"] == "bf16"
        assert rep.ok, rep.stages
        assert rep.max_loss_diff <= atol, (rep.losses, rep.reference_losses)
        assert rep.max_grad_diff > 1e-6  # bf16 rounding differs from the reference somewhere


# -- loss scaler and verdicts (pure) -----------------------------------------------------------
def test_loss_scaler_halves_on_overflow_and_doubles_after_the_growth_interval() -> None:
    s = LossScaler()
    assert (s.scale, s.growth_interval) == (2.0**16, 2000)  # torch.amp.GradScaler defaults
    s.update(overflow=True)
    assert s.scale == 2.0**15
    for _ in range(1999):
        s.update(overflow=False)
    assert (s.scale, s.clean_steps) == (2.0**15, 1999)
    s.update(overflow=True)  # an overflow restarts the count
    assert (s.scale, s.clean_steps) == (2.0**14, 0)
    for _ in range(2000):
        s.update(overflow=False)
    assert (s.scale, s.clean_steps) == (2.0**15, 0)
    t = LossScaler()
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t == s


def _fp16() -> Precision:
    # a CUDA-typed precision: no autocast is entered in these tests, so no GPU is needed
    return Precision("fp16", torch.device("cuda"))


def test_precision_scales_the_loss_and_unscales_the_gradients() -> None:
    p = _fp16()
    loss = torch.tensor(0.75)
    assert float(p.scale(loss)) == 0.75 * 2**16
    w = nn.Parameter(torch.zeros(3))
    w.grad = torch.tensor([2.0**16, 3 * 2.0**16, -(2.0**15)])
    p.unscale([w])
    assert w.grad.tolist() == [1.0, 3.0, -0.5]
    assert p.scaler is not None and p.scaler.clean_steps == 1
    assert p.overflow(7) and p.loss_scale == 2.0**15 and p.overflow_steps == [7]
    plain = Precision("bf16", torch.device("cpu"))
    assert plain.scale(loss) is loss and not plain.overflow(0) and plain.state_dict() == {}
    w.grad = torch.ones(3)
    plain.unscale([w])
    assert w.grad.tolist() == [1.0, 1.0, 1.0]


def _longrun(precision: Precision) -> tuple[LongRun, nn.Module]:
    module = nn.Linear(2, 2)
    for q in module.parameters():
        q.grad = torch.ones_like(q)
    lr = LongRun(
        plan_of("1:1"), rw.mlp(), TrainConfig(), rank=0, world=1, stage=0, replica=0,
        module=module, optimizer=None, device=torch.device("cpu"), precision=precision,
    )  # fmt: skip
    return lr, module


def test_fp16_gradient_overflow_verdict_skips_and_lowers_the_scale() -> None:
    lr, module = _longrun(_fp16())
    assert lr.guard._verdict(3, [(1, 1, 2)]) == ""  # a non-finite gradient at stage 1, rank 2
    assert all(q.grad is None for q in module.parameters())
    assert lr.precision.loss_scale == 2.0**15 and lr.guard.skipped == []
    # a non-finite loss keeps the configured behaviour (stop), scale untouched
    msg = lr.guard._verdict(4, [(0, 1, 2), (1, 0, 0)])
    assert msg and "non-finite loss" in msg and lr.precision.loss_scale == 2.0**15
    # without loss scaling a non-finite gradient stops as before
    plain, _ = _longrun(Precision("bf16", torch.device("cpu")))
    assert "non-finite gradient" in (plain.guard._verdict(3, [(1, 1, 2)]) or "")


# -- bad inputs: one error line before any compute -----------------------------------------------
def test_bad_precisions_are_rejected_before_any_compute(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValidationError, match=r"precision must be one of fp32, bf16, fp16.*'fp8'"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValidationError, match=r"fp16 autocast on CPU is not supported.*bf16"):
        check_precision("fp16", "cpu")
    with pytest.raises(ValidationError, match="fp16 autocast on CPU"):
        api.train(plan_of("1:1"), "runtime_workloads:mlp", 1, precision="fp16", device="cpu")
    with pytest.raises(ValidationError, match="verify supports precision fp32 or bf16"):
        api.verify(plan_of("1:1"), "runtime_workloads:mlp", 1, precision="fp16", device="cuda")
    plan_of("1:1").save(tmp_path / "plan.json")
    for cmd in ("train", "verify"):
        argv = [cmd, "--plan", str(tmp_path / "plan.json"), "-m", "runtime_workloads:mlp"]
        assert main([*argv, "--precision", "fp16", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dapple: error:") and err.count("\n") == 1 and "bf16" in err
        assert main([*argv, "--precision", "half"]) == 2
        assert "'half'" in capsys.readouterr().err
    # a CUDA device without bf16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ValidationError, match="'Tesla V100' does not support bf16"):
        check_precision("bf16", "cuda")
    with pytest.raises(ValidationError, match="does not support bf16"):
        check_precision("bf16", "auto")
    check_precision("fp16", "cuda")


# -- profiles in a precision and the memory model ------------------------------------------------
def test_profile_records_its_precision_and_halves_activation_bytes(tmp_path: Path) -> None:
    fp32 = api.profile(rw.mlp(), [2, 4], device="cpu", repeats=1, warmup=0)
    bf16 = api.profile(
        rw.mlp(), [2, 4], device="cpu", repeats=1, warmup=0, precision="bf16",
        output=tmp_path / "bf16.json",
    )  # fmt: skip
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")
    assert ModelProfile.load(tmp_path / "bf16.json").precision == "bf16"
    for a, b in zip(fp32.layers, bf16.layers, strict=True):
        assert b.parameter_bytes == a.parameter_bytes  # fp32 master weights
        assert b.output_bytes_per_sample == pytest.approx(a.output_bytes_per_sample / 2)
        assert b.kept_activation_bytes_per_sample == pytest.approx(
            a.kept_activation_bytes_per_sample / 2
        )
    # older profiles carry no precision: fp32
    d = fp32.to_dict()
    del d["precision"]
    assert ModelProfile.from_dict(d).precision == "fp32"
    with pytest.raises(ValidationError, match="precision must be one of"):
        ModelProfile.from_dict({**d, "precision": "int8"})
    with pytest.raises(ValidationError, match="fp16 autocast on CPU"):
        api.profile(rw.mlp(), [2], device="cpu", repeats=1, warmup=0, precision="fp16")


def test_bf16_profile_records_what_autocast_casts() -> None:
    """A measured bf16 profile names the parameters autocast copies: a block's linears and the
    head's, not the embedding table (looked up) nor a norm's weight (run in fp32); an fp32
    profile casts nothing."""
    ov = {"layers": 2, "hidden": 64, "heads": 4, "seq": 16, "vocab": 512}
    bf16 = api.profile("transformer", [2, 4], device="cpu", overrides=ov, repeats=1, warmup=0,
                       precision="bf16")  # fmt: skip
    norm = 2 * 64 * 4  # a LayerNorm's weight and bias, fp32
    emb, block, head = bf16.layers[0], bf16.layers[1], bf16.layers[-1]
    assert emb.cast_parameter_bytes == 0
    assert block.cast_parameter_bytes == block.parameter_bytes - 2 * norm
    assert head.cast_parameter_bytes == head.parameter_bytes - norm
    assert ModelProfile.from_dict(bf16.to_dict()).layers == bf16.layers
    fp32 = api.profile("transformer", [2], device="cpu", overrides=ov, repeats=1, warmup=0)
    assert all(x.cast_parameter_bytes is None for x in fp32.layers)


def test_memory_model_adds_the_weight_cast_cache_in_low_precision() -> None:
    prof = api.profile(rw.mlp(), [2, 4], device="cpu", repeats=1, warmup=0)
    low = dataclasses.replace(prof, precision="bf16")
    stage = plan_of("1:1").stages[0]
    params = sum(ly.parameter_bytes for ly in prof.layers[0:2])
    assert weight_cast_bytes(prof, (0, 2)) == 0
    assert weight_cast_bytes(low, (0, 2)) == params / 4 * 2  # parameter count x 2 bytes
    assert parameter_state_bytes(low, (0, 2)) - parameter_state_bytes(prof, (0, 2)) == params / 2
    same_acts = stage_peak(low, stage, B, 2).static - stage_peak(prof, stage, B, 2).static
    assert same_acts == pytest.approx(params / 2)


def test_train_notes_a_profile_measured_in_another_precision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapple.api._checks import note_profile_precision

    prof = api.profile(rw.mlp(), [2], device="cpu", repeats=1, warmup=0, precision="bf16")
    prof.save(tmp_path / "p.json")
    note_profile_precision(str(tmp_path / "p.json"), "bf16")
    assert capsys.readouterr().err == ""
    note_profile_precision(str(tmp_path / "p.json"), "fp32")
    err = capsys.readouterr().err
    assert "measured in bf16" in err and "--precision fp32" in err


def test_weight_cache_keeps_one_cast_of_the_weights_for_all_micro_batches() -> None:
    p = Precision("bf16", torch.device("cpu"))
    layer = nn.Linear(8, 8)

    def cast_weights_saved(shared: bool) -> int:
        ptrs: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.bfloat16 and t.shape == layer.weight.shape:
                ptrs.add(t.untyped_storage().data_ptr())
            return t

        outs = []
        with p.weight_cache() if shared else contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                for _ in range(3):  # three micro-batch forwards, each in its own autocast
                    with p.autocast():
                        outs.append(layer(torch.randn(2, 8, requires_grad=True)))
            assert all(o.dtype == torch.bfloat16 for o in outs)
            sum(o.float().sum() for o in outs).backward()
        return len(ptrs)

    assert cast_weights_saved(shared=False) == 3
    assert cast_weights_saved(shared=True) == 1
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32


def test_cli_profile_precision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "-m", "runtime_workloads:mlp", "--batch-sizes", "2", "--device", "cpu"]
    argv += ["--repeats", "1", "--warmup", "0", "-o", str(out)]
    assert main([*argv, "--precision", "bf16"]) == 0
    assert json.loads(out.read_text())["precision"] == "bf16"
    capsys.readouterr()
    assert main([*argv, "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dapple: error:") and err.count("\n") == 1 and "bf16" in err


def test_co_worker_profile_in_bf16() -> None:
    from dapple.profiler.measure import profile_workload

    prof = profile_workload(
        rw.mlp(), [1, 2], repeats=1, warmup=0, num_threads=1, co_workers=2, precision="bf16"
    )
    assert prof.precision == "bf16" and "2 co-workers" in prof.device
    assert prof.layers[0].output_bytes_per_sample == rw.HID * 2  # bf16 activations
