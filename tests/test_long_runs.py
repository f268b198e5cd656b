"""Long runs: resume (same plan exactly, other plans by layer), NaN guard, restarts, kill mid-save.

One group of 4 gloo workers is spawned ONCE and runs every in-process scenario in order; the
CLI scenarios (torchrun restart, a worker killed during a save) each start one job.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime_workloads as rw
from dapple.core.plan import Plan, StagePlan, interleave
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import (
    CRASH_IN_SAVE_ENV,
    MANIFEST_NAME,
    CheckpointError,
    latest_checkpoint,
    load_layer_states,
    step_dir,
)

TESTS = Path(__file__).parent
B, M, STEPS, CUT, SEED, LR = 4, 2, 5, 2, 1, 0.05
G = B * M
NAN_STEP, NAN_ROW = 3, 5  # row 5 = micro-batch 1, replica 0 of a 2-replica stage (rows 4, 5)

PLANS = {
    "2:2": (((0, 2), (0, 1)), ((2, 4), (2, 3))),
    "3:1": (((0, 2), (0, 1, 2)), ((2, 4), (3,))),
    "straight4": (((0, 1), (0,)), ((1, 2), (1,)), ((2, 3), (2,)), ((3, 4), (3,))),
    "dp4": (((0, 4), (0, 1, 2, 3)),),
    "straight2": (((0, 3), (0,)), ((3, 4), (1,))),  # 2 processes (ranks 2, 3 idle)
}


INTERLEAVED = {  # name -> (the plan whose groups take v = 2 chunks each)
    "interleaved": "straight2x2",
    "interleaved-2:2": "2:2",
}
PLANS["straight2x2"] = (((0, 2), (0,)), ((2, 4), (1,)))


def plan_of(name: str) -> Plan:
    if name in INTERLEAVED:
        return interleave(plan_of(INTERLEAVED[name]), 2)
    return Plan(
        planner="test",
        global_batch_size=G,
        micro_batch_size=B,
        num_micro_batches=M,
        stages=tuple(StagePlan(layers=lay, devices=dev) for lay, dev in PLANS[name]),
    )


# -- workloads that go non-finite at step NAN_STEP (seed + step == SEED + NAN_STEP) -------------
def _nan_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = rw._mlp_batch(n, seed)
    if seed == SEED + NAN_STEP:
        x[NAN_ROW, 0] = float("nan")
    return x, y


def nan_mlp() -> Workload:
    """``runtime_workloads.mlp`` whose input holds a NaN at step NAN_STEP (non-finite loss)."""
    wl = rw.mlp()
    return Workload(wl.name, wl.layer_factories, _nan_batch, wl.loss_fn)


class _NanGradWhere(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(flag)
        return h.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (flag,) = ctx.saved_tensors
        return torch.where(flag[:, None], torch.full_like(g, float("nan")), g), None


class _GradBombLayer(nn.Module):
    """Linear+Tanh whose backward is NaN for rows marked by input feature 0 == 1e4."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(rw.IN, rw.HID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_NanGradWhere.apply(self.lin(x), x[:, 0] == 1e4))


def _bomb_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = rw._mlp_batch(n, seed)
    if seed == SEED + NAN_STEP:
        x[NAN_ROW, 0] = 1e4
    return x, y


def grad_nan_mlp() -> Workload:
    """Finite losses, but a NaN gradient in stage 0 at step NAN_STEP."""
    wl = rw.mlp()
    return Workload(
        "test-mlp-bomb", [_GradBombLayer, *wl.layer_factories[1:]], _bomb_batch, wl.loss_fn
    )


def reference(
    wl: Workload, steps: int, skip: tuple[int, ...] = ()
) -> tuple[nn.Sequential, list[float]]:
    """Single-process Adam training of the whole model; steps in ``skip`` take no update."""
    model = wl.build_model(SEED)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for t in range(steps):
        x, y = wl.make_batch(G, SEED + t)
        opt.zero_grad()
        loss = wl.loss_fn(model(x), y)
        loss.backward()
        if t not in skip:
            opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def _close_to(module: nn.Module, ref: nn.Sequential, layers: Sequence[int]) -> int:
    """Compare ``module``'s children (the chain's ``layers``) with the reference's."""
    n = 0
    for i, layer in zip(layers, module.children(), strict=True):
        for (name, got), (_, want) in zip(
            layer.state_dict().items(), ref[i].state_dict().items(), strict=True
        ):
            torch.testing.assert_close(
                got, want, msg=lambda m, where=f"{i}.{name}": f"{where}: {m}"
            )
            n += 1
    return n


class _Collect(logging.Handler):
    """Keeps the messages of the records it handles."""

    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _scenario(name: str, results: dict, fn) -> None:
    try:
        results[name] = {"ok": True, **(fn() or {})}
    except Exception as e:
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}


def worker(rank: int, world: int, out_dir: str) -> None:
    """Every in-process scenario, in one process group (ranks outside a plan idle through)."""
    from dapple.runtime import TrainConfig, init_distributed, run_plan

    device = init_distributed(TrainConfig(timeout_s=30), world)
    out = Path(out_dir)
    base = dict(seed=SEED, optimizer="adam", lr=LR, timeout_s=30)
    wl = rw.mlp()
    res: dict[str, dict] = {}
    p22 = plan_of("2:2")

    def run(plan: Plan, w: Workload = wl, **kw):
        return run_plan(plan, w, TrainConfig(**{**base, **kw}), device=device, exact_world=False)

    full = run(p22, steps=STEPS)
    ck = str(out / "ck")
    part = run(p22, steps=CUT, checkpoint_dir=ck, save_every=1, keep=1)
    again = run(p22, steps=STEPS, checkpoint_dir=ck, resume=True)  # save_every 0: reads only

    def same_plan_exact():
        for a, b in zip(again.module.parameters(), full.module.parameters(), strict=True):
            assert torch.equal(a, b)
        if rank == 0:
            got = [m.loss for m in part.metrics + again.metrics]
            assert got == [m.loss for m in full.metrics], (got, [m.loss for m in full.metrics])
            assert [m.step for m in again.metrics] == list(range(CUT, STEPS))
        return {"dirs": sorted(p.name for p in Path(ck).iterdir())}

    _scenario("same-plan", res, same_plan_exact)
    ref_model, ref_losses = reference(wl, STEPS)
    for name in ("3:1", "straight4", "dp4", "straight2", "interleaved", "interleaved-2:2"):
        plan = plan_of(name)
        r = run(plan, steps=STEPS, checkpoint_dir=ck, resume=True)

        def other_plan(r=r, plan=plan):
            n = 0
            if r.module is not None:
                n = _close_to(r.module, ref_model, plan.layers_of_device(rank))
            if rank == 0:
                torch.testing.assert_close(
                    torch.tensor([m.loss for m in r.metrics]), torch.tensor(ref_losses[CUT:])
                )
            return {"checked": n}

        _scenario(name, res, other_plan)

    # saved by an interleaved run (each group's replica 0 writes its chunks' layers), resumed
    # under 2:2
    ick = str(out / "interleaved")
    run(plan_of("interleaved-2:2"), steps=CUT, checkpoint_dir=ick, save_every=1)
    back = run(p22, steps=STEPS, checkpoint_dir=ick, resume=True)

    def from_interleaved():
        n = _close_to(back.module, ref_model, p22.layers_of_device(rank))
        if rank == 0:
            torch.testing.assert_close(
                torch.tensor([m.loss for m in back.metrics]), torch.tensor(ref_losses[CUT:])
            )
        return {"checked": n}

    _scenario("from-interleaved", res, from_interleaved)

    # non-finite loss, default policy: every rank stops before the optimizer step
    nck = str(out / "nan")

    def nan_stop():
        try:
            run(p22, w=nan_mlp(), steps=STEPS, checkpoint_dir=nck, save_every=1)
        except Exception as e:
            return {"error": str(e), "type": type(e).__name__}
        raise AssertionError("the NaN step did not stop the run")

    _scenario("nan-stop", res, nan_stop)

    def nan_skip():
        r = run(p22, w=nan_mlp(), steps=STEPS, on_nonfinite="skip")
        n = _close_to(
            r.module, reference(nan_mlp(), STEPS, skip=(NAN_STEP,))[0], p22.layers_of_device(rank)
        )
        return {"checked": n, "losses": [m.loss for m in r.metrics]}

    _scenario("nan-skip", res, nan_skip)

    def grad_stop():
        try:
            run(p22, w=grad_nan_mlp(), steps=STEPS)
        except Exception as e:
            return {"error": str(e)}
        raise AssertionError("the NaN gradient did not stop the run")

    _scenario("grad-stop", res, grad_stop)
    for zero in (1, 2):  # the replay that names the micro-batch checks the gradient shards

        def grad_stop_zero(zero=zero):
            try:
                run(p22, w=grad_nan_mlp(), steps=STEPS, zero_stage=zero)
            except Exception as e:
                return {"error": str(e)}
            raise AssertionError("the NaN gradient did not stop the run")

        _scenario(f"grad-stop-zero{zero}", res, grad_stop_zero)

    def grad_skip():
        warned: list[str] = []
        catch = _Collect(warned)
        logging.getLogger("dapple.runtime.guard").addHandler(catch)
        try:  # the step is replayed to name its micro-batch, then dropped
            r = run(p22, w=grad_nan_mlp(), steps=STEPS, on_nonfinite="skip")
        finally:
            logging.getLogger("dapple.runtime.guard").removeHandler(catch)
        ref = reference(grad_nan_mlp(), STEPS, skip=(NAN_STEP,))
        n = _close_to(r.module, ref[0], p22.layers_of_device(rank))
        if rank == 0:
            torch.testing.assert_close(
                torch.tensor([m.loss for m in r.metrics]), torch.tensor(ref[1])
            )
        return {"checked": n, "warned": warned}

    _scenario("grad-skip", res, grad_skip)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    # last: every rank of a straight run really dies (os._exit) in the middle of its 2nd save
    os.environ[CRASH_IN_SAVE_ENV] = "2"
    run(plan_of("straight4"), steps=STEPS, checkpoint_dir=str(out / "killed"), save_every=1)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    from dapple.runtime import RankFailure, spawn

    out = tmp_path_factory.mktemp("longrun")
    with pytest.raises(RankFailure, match="4 of 4 workers failed: rank 0 exit 3"):
        spawn(worker, 4, str(out), timeout_s=60)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _ok(spawned, name: str) -> list[dict]:
    rows = [rep[name] for rep in spawned[1]]
    for rank, row in enumerate(rows):
        assert row["ok"], f"rank {rank}: {row.get('error')}"
    return rows


@pytest.mark.slow
def test_resume_same_plan_is_exact(spawned) -> None:
    rows = _ok(spawned, "same-plan")
    assert rows[0]["dirs"] == [f"step-{CUT:08d}"]  # keep=1 pruned step 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan", ["3:1", "straight4", "dp4", "straight2", "interleaved", "interleaved-2:2"]
)
def test_resume_saved_2_2_under_another_plan(spawned, plan: str) -> None:
    rows = _ok(spawned, plan)
    # every layer's tensors were compared once per replica of the stage that holds them
    per_layer = 2  # weight, bias
    assert sum(r["checked"] for r in rows) == per_layer * sum(
        len(devs) * (hi - lo) for (lo, hi), devs in PLANS[INTERLEAVED.get(plan, plan)]
    )


@pytest.mark.slow
def test_checkpoint_of_an_interleaved_run_resumes_under_2_2(spawned) -> None:
    rows = _ok(spawned, "from-interleaved")
    assert sum(r["checked"] for r in rows) == 2 * 4 * 2  # 4 layers on 2 replicas each


@pytest.mark.slow
def test_nonfinite_loss_stops_before_the_update_and_keeps_the_checkpoint(spawned) -> None:
    rows = _ok(spawned, "nan-stop")
    for r in rows:
        assert r["type"] == "RankFailure"
        assert "\n" not in r["error"]
        assert r["error"].startswith(
            f"step {NAN_STEP}: non-finite loss in micro-batch 1 at stage 1"
        )
        assert f"last good checkpoint: step {NAN_STEP}" in r["error"]
    ck = latest_checkpoint(spawned[0] / "nan")
    assert ck is not None and ck.step == NAN_STEP
    assert not step_dir(spawned[0] / "nan", NAN_STEP + 1).exists()
    ref, _ = reference(nan_mlp(), NAN_STEP)
    states = load_layer_states(ck, range(4))
    for i in range(4):
        for k, v in states[i].tensors.items():
            torch.testing.assert_close(v, ref[i].state_dict()[k])


@pytest.mark.slow
def test_nonfinite_skip_drops_the_step_and_goes_on(spawned) -> None:
    rows = _ok(spawned, "nan-skip")
    losses = rows[0]["losses"]
    assert len(losses) == STEPS and losses[NAN_STEP] != losses[NAN_STEP]  # NaN reported
    assert all(x == x for i, x in enumerate(losses) if i != NAN_STEP)
    assert all(r["checked"] == 4 for r in rows)


@pytest.mark.slow
def test_nonfinite_gradient_names_stage_and_micro_batch(spawned) -> None:
    rows = _ok(spawned, "grad-stop")
    for r in rows:
        assert r["error"].startswith(
            f"step {NAN_STEP}: non-finite gradient in micro-batch 1 at stage 0 (rank 0)"
        ), r["error"]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_nonfinite_gradient_is_named_under_zero(spawned, zero: int) -> None:
    rows = _ok(spawned, f"grad-stop-zero{zero}")
    for r in rows:
        assert r["error"].startswith(
            f"step {NAN_STEP}: non-finite gradient in micro-batch 1 at stage 0 (rank 0)"
        ), r["error"]


@pytest.mark.slow
def test_nonfinite_gradient_skip_names_the_micro_batch_and_trains_as_if_dropped(spawned) -> None:
    """The replay that names the micro-batch leaves nothing behind: the run equals the
    reference that skips the step, and rank 0 warns once, naming it."""
    rows = _ok(spawned, "grad-skip")
    assert all(r["checked"] == 4 for r in rows)
    assert rows[0]["warned"] == [
        f"step {NAN_STEP} skipped: non-finite gradient in micro-batch 1 at stage 0 (rank 0)"
    ]
    assert all(r["warned"] == [] for r in rows[1:])


# -- through the CLI -----------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    env.update(extra)
    return env


def _train_args(tmp: Path, plan: str, steps: int = STEPS) -> list[str]:
    plan_of(plan).save(tmp / f"{plan}.json")
    return [
        "train", "--plan", str(tmp / f"{plan}.json"), "--model", "runtime_workloads:mlp",
        "--steps", str(steps), "--seed", str(SEED), "--optimizer", "adam", "--lr", str(LR),
        "--timeout-s", "20", "--checkpoint-dir", str(tmp / "ck"), "--save-every", "1",
    ]  # fmt: skip


def _final_matches_reference(root: Path, steps: int = STEPS) -> None:
    ck = latest_checkpoint(root)
    assert ck is not None and ck.step == steps
    ref, _ = reference(rw.mlp(), steps)
    states = load_layer_states(ck, range(4))
    for i in range(4):
        for k, v in states[i].tensors.items():
            torch.testing.assert_close(v, ref[i].state_dict()[k])


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_from_the_last_checkpoint(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to the interpreter")
    from dapple.runtime import free_port
    from dapple.runtime.startup import FAIL_RANK_ENV, FAIL_STEP_ENV

    t0 = time.monotonic()
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "4", "--max-restarts", "1",
         "--master-port", str(free_port()), "-m", "dapple",
         *_train_args(tmp_path, "2:2"), "--resume"],
        capture_output=True, text=True, timeout=180,
        env=_env(**{FAIL_RANK_ENV: "2", FAIL_STEP_ENV: "3"}),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dapple: error: step 3: rank " in proc.stderr  # the first attempt did fail
    steps = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps[-2:] == [3, 4] and steps.count(3) == 1, proc.stdout  # resumed at 3, not 0
    _final_matches_reference(tmp_path / "ck")
    print(f"torchrun restart test took {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
def test_process_killed_during_a_save_leaves_the_previous_checkpoint(spawned) -> None:
    root = spawned[0] / "killed"
    half = step_dir(root, 2)
    assert sorted(p.name for p in half.glob("layer-*")) == [f"layer-{i:05d}.pt" for i in range(4)]
    assert not (half / MANIFEST_NAME).exists()
    ck = latest_checkpoint(root)
    assert ck is not None and ck.step == 1
    ref, _ = reference(rw.mlp(), 1)
    states = load_layer_states(ck, range(4))
    for i in range(4):
        for k, v in states[i].tensors.items():
            torch.testing.assert_close(v, ref[i].state_dict()[k])


def test_cli_rejects_unwritable_checkpoint_dir_and_foreign_checkpoint(
    tmp_path: Path, capsys
) -> None:
    from dapple.api._checks import check_long_run
    from dapple.cli import main
    from dapple.runtime.checkpoint import CheckpointMeta, save_checkpoint, stage_layer_states

    blocker = tmp_path / "file"
    blocker.write_text("x")
    args = _train_args(tmp_path, "2:2")
    at = args.index("--checkpoint-dir") + 1
    args[at] = str(blocker / "ck")
    assert main(args) == 2  # before any worker starts
    err = capsys.readouterr().err
    assert err.startswith("dapple: error: --checkpoint-dir") and "is a file, not a directory" in err
    other = tmp_path / "other"
    m = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    meta = CheckpointMeta(model_name="not-mlp", num_layers=4, step=1)
    save_checkpoint(other, meta, stage_layer_states(m, 0))
    args[at] = str(other)
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "'not-mlp', not 'test-mlp'" in err and err.count("\n") == 1, err
    same = tmp_path / "same"
    mlp_chain = rw.mlp().build_model(0)  # the model's own shapes (others: refused up front)
    save_checkpoint(
        same,
        CheckpointMeta(model_name="test-mlp", num_layers=4, step=1),
        stage_layer_states(mlp_chain, 0),
    )
    with pytest.raises(CheckpointError, match="plan covers 2 layers"):
        check_long_run(str(same), rw.mlp(), 2, resume=True)
    check_long_run(str(same), rw.mlp(), 4, resume=True)
    # a damaged newest checkpoint: one line naming the file, before any worker starts
    layer = sorted((same / "step-00000001").glob("layer*"))[1]
    raw = bytearray(layer.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    layer.write_bytes(bytes(raw))
    args[at] = str(same)
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is corrupted: sha256" in err and layer.name in err, err


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"save_every": 1}, "need a checkpoint_dir"),
        ({"resume": True}, "need a checkpoint_dir"),
        ({"checkpoint_dir": "x", "save_every": -1}, "save_every must be >= 0"),
        ({"checkpoint_dir": "x", "keep": 0}, "keep must be >= 1"),
        ({"on_nonfinite": "ignore"}, "stop or skip"),
    ],
)
def test_train_config_rejects_bad_long_run_options(kw: dict, needle: str) -> None:
    from dapple.errors import ValidationError
    from dapple.runtime import TrainConfig

    with pytest.raises(ValidationError, match=needle):
        TrainConfig(**kw)


@pytest.mark.slow
def test_cli_nonfinite_exits_nonzero_naming_step_stage_micro_batch(tmp_path: Path) -> None:
    args = _train_args(tmp_path, "straight2")
    args[args.index("--model") + 1] = "test_long_runs:nan_mlp"
    proc = subprocess.run(
        [sys.executable, "-m", "dapple", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("dapple: error: step")]
    assert len(lines) == 2, proc.stderr  # one line per worker, then the launcher's summary
    for line in lines:
        assert line.startswith(
            f"dapple: error: step {NAN_STEP}: non-finite loss in micro-batch 1 at stage 1 (rank 1); "
            "also non-finite at stage 0; stopped before the optimizer step; "
            f"last good checkpoint: step {NAN_STEP} in "
        ), line
    ck = latest_checkpoint(tmp_path / "ck")
    assert ck is not None and ck.step == NAN_STEP
    load_layer_states(ck, range(4))  # whole: sizes and checksums verified
