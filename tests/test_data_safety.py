"""Nothing saved is lost: checkpoints of another run, damaged newest steps, non-finite weights,
resumes with nothing or the wrong optimizer, exports that would drop tensors, refused commands.

The fast tests drive the CLI in this process with ``dapple.runtime.train`` replaced, so a
refusal is proved to come before any worker starts, and :class:`LongRun` with a world of one;
the ``slow`` ones run real training processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import runtime_workloads as rw
from dapple.cli import main
from dapple.cli.train_cmd import DEFAULT_KEEP
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.runtime import TrainConfig
from dapple.runtime.checkpoint import (
    CHECKPOINT_SCHEMA_VERSION,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointMeta,
    DamagedCheckpointError,
    find_resume_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_layer_states,
    prune_checkpoints,
    save_checkpoint,
    stage_layer_states,
    step_dir,
)
from dapple.runtime.longrun import LongRun

TESTS = Path(__file__).parent
G, M = 4, 2


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _save(root: Path, step: int, *, optimizer: str = "SGD", seed: int = 0) -> nn.Sequential:
    """A checkpoint of ``runtime_workloads.mlp`` (4 layers, ``test-mlp``) at ``step``."""
    chain = rw.mlp().build_model(seed)
    meta = CheckpointMeta(model_name="test-mlp", num_layers=4, step=step, optimizer_type=optimizer)
    save_checkpoint(root, meta, stage_layer_states(chain, 0))
    return chain


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# -- the CLI, with the launch replaced ------------------------------------------------------
@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every ``dapple.runtime.train`` call the CLI makes (none starts a process)."""
    calls: list[dict[str, Any]] = []

    def fake_train(plan: Any, workload: Any, config: TrainConfig, **kw: Any) -> list[Any]:
        calls.append({**dataclasses.asdict(config), **kw})
        return []

    monkeypatch.setattr("dapple.runtime.train", fake_train)
    return calls


def _train(tmp: Path, ck: Path | str, *extra: str, layers: int = 4) -> list[str]:
    plan = tmp / f"plan{layers}.json"
    straight_plan(layers, [0], global_batch_size=G, num_micro_batches=M).save(plan)
    return ["train", "--plan", str(plan), "--model", "runtime_workloads:mlp", "--steps", "4",
            "--checkpoint-dir", str(ck), *extra]  # fmt: skip


def _err_lines(capsys: pytest.CaptureFixture[str], kind: str = "error") -> list[str]:
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("dapple: ") for line in err), err
    return [line for line in err if line.startswith(f"dapple: {kind}:")]


@pytest.mark.parametrize("keep", [[], ["--keep", "2"]])
def test_train_into_another_runs_checkpoints_is_refused_before_launch(
    tmp_path: Path, launches: list, capsys: pytest.CaptureFixture[str], keep: list[str]
) -> None:
    ck = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(ck, step, seed=7)
    before = _tree(ck)
    assert main(_train(tmp_path, ck, "--save-every", "1", *keep)) == 2
    (line,) = _err_lines(capsys)
    assert "already holds checkpoints (steps 1, 2, 3)" in line
    assert "--resume" in line and "--overwrite-checkpoints" in line
    assert launches == [] and _tree(ck) == before


def test_overwrite_and_resume_flags_reach_the_run(
    tmp_path: Path, launches: list, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    _save(ck, 1)
    before = _tree(ck)
    assert main(_train(tmp_path, ck, "--save-every", "1", "--overwrite-checkpoints")) == 0
    (warning,) = _err_lines(capsys, "warning")
    assert "--overwrite-checkpoints" in warning and "deleted at this run's first save" in warning
    assert launches[-1]["overwrite_checkpoints"] and not launches[-1]["resume"]
    assert _tree(ck) == before  # the CLI deletes nothing: the run's first save does
    assert main(_train(tmp_path, ck, "--resume", "--overwrite-checkpoints")) == 2
    assert "give one" in _err_lines(capsys)[0] and len(launches) == 1
    with pytest.raises(ValidationError, match="resume keeps the checkpoints"):
        TrainConfig(checkpoint_dir="x", resume=True, overwrite_checkpoints=True)


def test_keep_defaults_to_a_bound_and_zero_keeps_all(
    tmp_path: Path, launches: list, capsys: pytest.CaptureFixture[str]
) -> None:
    assert DEFAULT_KEEP == 3
    assert main(_train(tmp_path, tmp_path / "a", "--save-every", "1")) == 0
    assert launches[-1]["keep"] == DEFAULT_KEEP
    assert main(_train(tmp_path, tmp_path / "b", "--save-every", "1", "--keep", "0")) == 0
    assert launches[-1]["keep"] is None  # TrainConfig: keep every checkpoint
    assert main(_train(tmp_path, tmp_path / "c", "--keep", "-1")) == 2
    assert "--keep must be >= 0" in _err_lines(capsys)[0] and len(launches) == 2
    section = (TESTS.parent / "README.md").read_text().split("## Long runs")[1].split("\n## ")[0]
    assert f"`--keep K` (default {DEFAULT_KEEP})" in section and "K x one checkpoint" in section
    assert "`--keep 0` keeps every checkpoint" in section


def test_resume_with_nothing_warns_and_require_resume_refuses(
    tmp_path: Path, launches: list, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "chekpoints"
    assert main(_train(tmp_path, typo, "--resume")) == 0
    (warning,) = _err_lines(capsys, "warning")
    assert "no checkpoint in" in warning and "no such directory" in warning
    assert "starting at step 0" in warning and launches[-1]["resume"]
    assert not typo.exists()
    assert main(_train(tmp_path, typo, "--require-resume")) == 2
    (line,) = _err_lines(capsys)
    assert "--require-resume: no checkpoint to resume" in line and str(typo) in line
    (tmp_path / "empty").mkdir()
    assert main(_train(tmp_path, tmp_path / "empty", "--require-resume")) == 2
    assert "none there" in _err_lines(capsys)[0]
    assert len(launches) == 1 and not typo.exists()
    _save(tmp_path / "ok", 2)
    assert main(_train(tmp_path, tmp_path / "ok", "--require-resume")) == 0
    assert launches[-1]["resume"] and _err_lines(capsys, "warning") == []


def test_resume_with_another_optimizer_is_refused_before_launch(
    tmp_path: Path, launches: list, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    _save(ck, 1, optimizer="AdamW")
    assert main(_train(tmp_path, ck, "--resume", "--optimizer", "sgd")) == 2
    (line,) = _err_lines(capsys)
    assert "has AdamW optimizer state; cannot resume with SGD" in line and launches == []
    assert main(_train(tmp_path, ck, "--resume", "--optimizer", "adamw")) == 0


def test_damaged_newest_checkpoint_falls_back_with_a_warning(
    tmp_path: Path, launches: list, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(ck, step)
    _corrupt(step_dir(ck, 3) / "layer-00001.pt")
    (step_dir(ck, 2) / "layer-00003.pt").unlink()  # a missing file
    before = _tree(ck)
    assert main(_train(tmp_path, ck, "--resume")) == 0
    warnings = _err_lines(capsys, "warning")
    assert len(warnings) == 2 and launches[-1]["resume"]
    assert "layer-00001.pt" in warnings[0] and "corrupted" in warnings[0]
    assert "layer-00003.pt" in warnings[1] and "missing" in warnings[1]
    assert all("resuming from the older step 1" in w for w in warnings)
    assert _tree(ck) == before  # damaged checkpoints are passed over, never deleted


def test_find_resume_checkpoint_skips_damage_but_not_a_newer_schema(tmp_path: Path) -> None:
    assert find_resume_checkpoint(tmp_path / "nothing").checkpoint is None
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    step_dir(tmp_path, 5).mkdir()  # a save that crashed: no manifest
    (step_dir(tmp_path, 4) / MANIFEST_NAME).write_text("{not json")
    f = step_dir(tmp_path, 3) / "layer-00002.pt"
    f.write_bytes(f.read_bytes()[:64])
    point = find_resume_checkpoint(tmp_path)
    assert point.checkpoint is not None and point.checkpoint.step == 2
    assert len(point.skipped) == 2 and "not valid JSON" in point.skipped[0]
    assert "truncated" in point.skipped[1]
    latest = latest_checkpoint(tmp_path)  # manifests only: passes over step 4's, not step 3's
    assert latest is not None and latest.step == 3
    _corrupt(step_dir(tmp_path, 2) / "rng-rank00000.pt")
    _corrupt(step_dir(tmp_path, 1) / "layer-00000.pt")
    with pytest.raises(DamagedCheckpointError, match="no older intact checkpoint"):
        find_resume_checkpoint(tmp_path)
    mp = step_dir(tmp_path, 4) / MANIFEST_NAME
    mp.write_text(json.dumps({"schema_version": CHECKPOINT_SCHEMA_VERSION + 1}))
    with pytest.raises(CheckpointError, match="newer than this dapple") as e:
        find_resume_checkpoint(tmp_path)
    assert not isinstance(e.value, DamagedCheckpointError)


def test_keep_never_prunes_below_a_damaged_newer_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2, 9):  # 9: damaged, left by the run that is resumed from 2
        _save(tmp_path, step)
    _corrupt(step_dir(tmp_path, 9) / "layer-00000.pt")
    _save(tmp_path, 3)
    prune_checkpoints(tmp_path, 1, newest_step=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000009"]


# -- LongRun in one process (a world of one) ------------------------------------------------
def _longrun(root: Path, seed: int = 0, **cfg: Any) -> LongRun:
    wl: Workload = rw.mlp()
    plan = straight_plan(4, [0], global_batch_size=G, num_micro_batches=M)
    module = wl.build_stage(0, 4, seed)
    config = TrainConfig(checkpoint_dir=str(root), save_every=1, seed=seed, **cfg)
    return LongRun(plan, wl, config, rank=0, world=1, stage=0, replica=0, module=module,
                   optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                   device=torch.device("cpu"))  # fmt: skip


def test_longrun_refuses_an_occupied_directory(tmp_path: Path) -> None:
    _save(tmp_path / "ck", 1)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(step 1\)"):
        _longrun(tmp_path / "ck")
    _longrun(tmp_path / "ck", resume=True)
    _longrun(tmp_path / "ck", overwrite_checkpoints=True)
    _longrun(tmp_path / "new")
    assert not (tmp_path / "new").exists()  # made by the first save, not before


def _poison(run: LongRun) -> None:
    assert run.module is not None
    with torch.no_grad():
        next(run.module.parameters()).view(-1)[0] = float("inf")


def test_nonfinite_weights_are_never_saved(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run = _longrun(ck)
    run.after_step(0)
    assert run.last_good == 1
    _poison(run)
    with pytest.raises(CheckpointError) as e:
        run.after_step(1)
    msg = str(e.value)
    assert "step 1: non-finite weights after the optimizer step at stage 0 (rank 0)" in msg
    assert f"last good checkpoint: step 1 in {ck}" in msg and "\n" not in msg
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000001"]
    fresh = _longrun(tmp_path / "fresh")
    _poison(fresh)
    with pytest.raises(CheckpointError, match="last good checkpoint: none yet"):
        fresh.after_step(0)
    assert not (tmp_path / "fresh").exists()


def test_overwrite_deletes_the_old_run_at_the_first_save_only(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(ck, step, seed=7)
    before = _tree(ck)
    run = _longrun(ck, overwrite_checkpoints=True, seed=1)
    _poison(run)
    with pytest.raises(CheckpointError, match="non-finite weights"):
        run.after_step(0)
    assert _tree(ck) == before  # a run that saved nothing deleted nothing
    run = _longrun(ck, overwrite_checkpoints=True, seed=1)
    run.after_step(0)
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000001"]
    ck1 = latest_checkpoint(ck)
    assert ck1 is not None and ck1.meta.extra["seed"] == 1  # this run's, not the old one's
    run.after_step(1)  # later saves delete nothing more
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000001", "step-00000002"]


def test_longrun_resumes_from_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    run = _longrun(ck)
    saved = {}
    for step in range(3):
        assert run.module is not None
        with torch.no_grad():
            for p in run.module.parameters():
                p.add_(0.5)
        run.after_step(step)
        saved[step + 1] = {k: v.clone() for k, v in run.module.state_dict().items()}
    _corrupt(step_dir(ck, 3) / "layer-00002.pt")
    again = _longrun(ck, resume=True)
    assert again.resume() == 2 and again.last_good == 2
    assert again.module is not None
    for k, v in again.module.state_dict().items():
        torch.testing.assert_close(v, saved[2][k], rtol=0, atol=0)


# -- export ---------------------------------------------------------------------------------
def _zoo_transformer_checkpoint(root: Path) -> tuple[Workload, int]:
    from dapple.models.zoo.transformer import transformer

    wl = transformer(layers=2, hidden=16, heads=2, seq=8)
    chain = wl.build_model(0)
    meta = CheckpointMeta(model_name=wl.name, num_layers=wl.num_layers, step=1)
    save_checkpoint(root, meta, stage_layer_states(chain, 0))
    return wl, sum(len(layer.state_dict()) for layer in chain)


def test_export_without_a_model_writes_every_tensor_of_shared_names(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from dapple.runtime.export import export_checkpoint

    _, held = _zoo_transformer_checkpoint(tmp_path / "ck")
    assert held == 30
    result = export_checkpoint(tmp_path / "ck", tmp_path / "out")
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert result.num_tensors == held == len(tensors)
    ck = latest_checkpoint(tmp_path / "ck")
    assert ck is not None
    for i, state in load_layer_states(ck, range(ck.meta.num_layers)).items():
        for name, t in state.tensors.items():
            torch.testing.assert_close(tensors[f"layers.{i}.{name}"], t, rtol=0, atol=0)


def test_export_refuses_to_write_a_subset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("safetensors")
    from dapple.runtime import export

    _zoo_transformer_checkpoint(tmp_path / "ck")
    monkeypatch.setattr(export, "_layer_prefixed", lambda ck: False)  # names would collide
    with pytest.raises(CheckpointError, match="would write 18 of 30 tensors"):
        export.export_checkpoint(tmp_path / "ck", tmp_path / "deep" / "out")
    assert not (tmp_path / "deep").exists()


def test_export_into_an_unwritable_place_is_one_line_before_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path / "ck", 1)
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "hf"
    # the unknown model would be an error of its own: the target is checked first
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ck"), "--out-dir", str(out),
                 "-m", "no_such_model"]) == 2  # fmt: skip
    (line,) = _err_lines(capsys)
    assert line.startswith(f"dapple: error: cannot write the export to {out}: Not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "file"]


def test_refused_commands_leave_no_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "new" / "deeper" / "ck"
    # a plan of 5 layers for a 4-layer model: refused in the launcher, after the CLI's checks
    assert main(_train(tmp_path, deep, "--save-every", "1", layers=5)) == 2
    assert "plan covers" in _err_lines(capsys)[0]
    assert main(_train(tmp_path, deep, "--require-resume")) == 2
    assert main(["export", "--checkpoint-dir", str(tmp_path / "none"),
                 "--out-dir", str(tmp_path / "new" / "hf")]) == 2  # fmt: skip
    assert "no checkpoint under" in _err_lines(capsys)[-1]  # no such directory
    assert not (tmp_path / "new").exists()


# -- real processes -------------------------------------------------------------------------
def _dapple(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run([sys.executable, "-m", "dapple", *args], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip


def _two_stage(
    tmp: Path, ck: Path, steps: int, *extra: str, model: str = "runtime_workloads:mlp"
) -> list[str]:
    plan = tmp / "plan22.json"
    straight_plan(4, [0, 2], global_batch_size=G, num_micro_batches=M).save(plan)
    return ["train", "--plan", str(plan), "--model", model, "--steps",
            str(steps), "--checkpoint-dir", str(ck), "--save-every", "1", "--timeout-s", "60",
            *extra]  # fmt: skip


@pytest.mark.slow
def test_two_ranks_agree_never_to_save_nonfinite_weights(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    steep = "runtime_workloads:steep_mlp"  # gradients near 1e15
    assert _dapple(_two_stage(tmp_path, ck, 2, "--lr", "1e-20", model=steep)).returncode == 0
    # a finite learning rate large enough that every weight overflows in the next update
    proc = _dapple(_two_stage(tmp_path, ck, 4, "--resume", "--lr", "1e30", model=steep))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "non-finite weights" in x]
    # every rank makes the same decision; the launcher says it once (launch/refusal)
    assert len(lines) == 1 and proc.returncode == 2, proc.stderr
    for line in lines:
        assert line.startswith("dapple: error: step 2: non-finite weights after the optimizer "
                               "step at stage 0 (rank 0); also at stage 1; checkpoint of step 3 "
                               f"not saved; last good checkpoint: step 2 in {ck}"), line  # fmt: skip
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000001", "step-00000002"]
    last = latest_checkpoint(ck)
    assert last is not None
    for state in load_layer_states(last, range(4)).values():
        assert all(bool(t.isfinite().all()) for t in state.tensors.values())


@pytest.mark.slow
def test_resume_past_a_damaged_step_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    full, ck = tmp_path / "full", tmp_path / "ck"
    assert _dapple(_two_stage(tmp_path, full, 4)).returncode == 0
    assert _dapple(_two_stage(tmp_path, ck, 3)).returncode == 0
    _corrupt(step_dir(ck, 3) / "layer-00003.pt")
    proc = _dapple(_two_stage(tmp_path, ck, 4, "--resume"))
    assert proc.returncode == 0, proc.stderr
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("dapple: warning:")]
    assert len(warnings) == 1 and "resuming from the older step 2" in warnings[0], proc.stderr
    assert [int(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("step ")] == [2, 3]
    a, b = latest_checkpoint(full), latest_checkpoint(ck)
    assert a is not None and b is not None and a.step == b.step == 4
    want, got = load_layer_states(a, range(4)), load_layer_states(b, range(4))
    for i in range(4):
        for k, v in want[i].tensors.items():
            torch.testing.assert_close(got[i].tensors[k], v, rtol=0, atol=0)
    assert [p.name for p in list_checkpoints(ck)] == [f"step-0000000{s}" for s in (2, 3, 4)]


@pytest.mark.slow
def test_overwrite_checkpoints_end_to_end(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    assert _dapple(_two_stage(tmp_path, ck, 3, "--seed", "5")).returncode == 0
    refused = _dapple(_two_stage(tmp_path, ck, 2, "--keep", "2"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert len(list_checkpoints(ck)) == 3
    proc = _dapple(_two_stage(tmp_path, ck, 2, "--overwrite-checkpoints"))
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000001", "step-00000002"]
    last = latest_checkpoint(ck)
    assert last is not None and last.meta.extra["seed"] == 0


def test_check_writable_tolerates_ranks_checking_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dapple.runtime.checkpoint import probe

    root = tmp_path / "a" / "ck"
    real_mkdir, real_mkstemp = Path.mkdir, probe.tempfile.mkstemp
    events: list[str] = []

    def mkdir_raced(self: Path, *a: Any, **k: Any) -> None:
        if self == root and "raced" not in events:  # another rank made it after our exists()
            events.append("raced")
            real_mkdir(self)
            raise FileExistsError(17, "File exists", str(self))
        real_mkdir(self, *a, **k)

    def mkstemp_removed(*a: Any, **k: Any) -> tuple[int, str]:
        if "removed" not in events:  # ... and removed it again before our probe
            events.append("removed")
            root.rmdir()
            raise FileNotFoundError(2, "No such file or directory")
        return real_mkstemp(*a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir_raced)
    monkeypatch.setattr(probe.tempfile, "mkstemp", mkstemp_removed)
    from dapple.runtime.checkpoint import check_writable

    assert check_writable(root) == root
    assert events == ["raced", "removed"]
    assert list(tmp_path.iterdir()) == []  # every directory this check made is gone


def test_listing_tolerates_a_directory_removed_by_another_ranks_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank lists the directory (refusing an occupied one) while another rank's write probe
    removes it between the listing's look and its read: the listing is empty, not an error."""
    root = tmp_path / "ck"
    root.mkdir()
    real_iterdir = Path.iterdir

    def iterdir_after_removal(self: Path) -> Any:
        if self == root and root.exists():
            root.rmdir()  # the other rank's probe cleans up first
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir_after_removal)
    assert list_checkpoints(root) == []
    from dapple.runtime.checkpoint import refuse_occupied

    root.mkdir()
    refuse_occupied(root, "unused")  # no FileNotFoundError
    assert list_checkpoints(tmp_path / "absent") == []
