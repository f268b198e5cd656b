"""A run says what it does: one line each for the start-up phases, weights loaded, a checkpoint
saved, a resume (step, path, data position) and an lr schedule re-derived on resume.

The in-process runs are one rank (``RANK=0 WORLD_SIZE=1``, as under ``torchrun``); the launcher's
own lines (processes started, workers in sessions of their own) need real processes (slow).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import runtime_workloads as rw
from dapple.core.plan import Plan, straight_plan
from dapple.host.own_session import SHARED_SESSION_ENV
from dapple.models.split import loaded_tensors, with_weights, workload_from_module
from dapple.runtime import TrainConfig, free_port, train
from dapple.runtime.checkpoint import step_dir
from dapple.runtime.longrun import data_position, lr_rederived
from dapple.runtime.optim import lr_at
from dapple.runtime.startup import stages_text

TESTS = Path(__file__).parent
SEED = 1


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is rank 0 of a world of 1 (``dapple.runtime.train`` runs in-process)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def _plan(layers: int = 4) -> Plan:
    return straight_plan(layers, [0], global_batch_size=4, num_micro_batches=2)


def _lines(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


# -- start-up phases, checkpoint saved, resumed, lr re-derived ----------------------------------
def test_start_up_phases_in_order(one_rank: None, capsys: pytest.CaptureFixture[str]) -> None:
    train(_plan(), rw.mlp(), TrainConfig(steps=1, echo=True))
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [
        "start-up: rendezvous",
        "start-up: building stage 0 (layers 0-3)",
        "start-up: probing the stage boundaries",
        "start-up: process groups and optimizer",
    ]
    assert out[4] == "start-up: first step (step 0)" and out[5].startswith("step 0 loss ")


def test_nothing_printed_without_echo(one_rank: None, capsys: pytest.CaptureFixture[str]) -> None:
    train(_plan(), rw.mlp(), TrainConfig(steps=1))
    assert capsys.readouterr().out == ""


def test_checkpoint_saved_resumed_and_lr_rederived(
    one_rank: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    opts: dict[str, Any] = dict(seed=SEED, echo=True, checkpoint_dir=str(ck), lr=0.1,
                                lr_schedule="cosine", warmup_steps=1)  # fmt: skip
    train(_plan(), rw.mlp(), TrainConfig(steps=3, save_every=2, **opts))
    out = capsys.readouterr().out
    assert _lines(out, "checkpoint saved:") == [  # every 2 steps, and the run's last step
        f"checkpoint saved: step 2 (steps 0-1 done) in {step_dir(ck, 2)}",
        f"checkpoint saved: step 3 (steps 0-2 done) in {step_dir(ck, 3)}",
    ]
    # --steps 3 -> 6: another schedule
    train(_plan(), rw.mlp(), TrainConfig(steps=6, resume=True, **opts))
    out = capsys.readouterr().out
    assert _lines(out, "resumed:") == [
        f"resumed: step 3 from {step_dir(ck, 3)} (same plan); data position: synthetic "
        f"batches, next make_batch seed {SEED + 3}"
    ]
    before = lr_at(3, lr=0.1, steps=3, schedule="cosine", warmup_steps=1)
    after = lr_at(3, lr=0.1, steps=6, schedule="cosine", warmup_steps=1)
    assert before != after
    assert _lines(out, "lr schedule") == [
        f"lr schedule re-derived: total steps 3 -> 6; lr at step 3 {before:.3g} -> {after:.3g} "
        "(now cosine over 6 steps)"
    ]
    # the resumed run's first step trains at the new schedule's lr, as the line says
    steps = _lines(out, "step 3 ")
    assert len(steps) == 1 and f" lr {after:.3g} " in steps[0], out
    assert out.index("resumed:") < out.index("start-up: first step (step 3)")


def test_same_schedule_on_resume_says_nothing_about_it(
    one_rank: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = str(tmp_path / "ck")
    train(_plan(), rw.mlp(), TrainConfig(steps=2, echo=True, checkpoint_dir=ck, save_every=1))
    # nothing left to run:
    train(_plan(), rw.mlp(), TrainConfig(steps=2, echo=True, checkpoint_dir=ck, resume=True))
    out = capsys.readouterr().out
    assert len(_lines(out, "checkpoint saved:")) == 2
    assert len(_lines(out, "resumed: step 2 ")) == 1 and not _lines(out, "lr schedule")


class _Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` samples of the MLP's batches."""

    def __init__(self, n: int) -> None:
        self.x, self.y = rw._mlp_batch(n, 0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def test_resume_on_a_dataset_names_epoch_batch_and_next_sample(
    one_rank: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck, data = str(tmp_path / "ck"), _Rows(10)  # G = 4: 2 batches per epoch, 2 samples dropped
    first = TrainConfig(steps=3, echo=True, checkpoint_dir=ck, save_every=3)
    train(_plan(), rw.mlp(), first, data=data)
    resumed = TrainConfig(steps=4, echo=True, checkpoint_dir=ck, resume=True)
    train(_plan(), rw.mlp(), resumed, data=data)
    (line,) = _lines(capsys.readouterr().out, "resumed:")
    assert line.endswith(
        "data position: epoch 1, batch 1 of 2, next sample 4 of the epoch's order of 10 "
        "(12 samples consumed)"
    ), line


def test_data_position_and_lr_rederived_in_words() -> None:
    saved = {"items": 100, "global_batch_size": 8, "seed": 0}
    assert data_position(saved, 25, 0) == (
        "epoch 2, batch 1 of 12, next sample 8 of the epoch's order of 100 (200 samples consumed)"
    )
    assert data_position(None, 7, 3) == "synthetic batches, next make_batch seed 10"
    cfg = TrainConfig(steps=200, lr=1e-3, lr_schedule="cosine", warmup_steps=10)
    old = {"steps": 100, "lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 10, "min_lr": 0.0}
    line = lr_rederived(old, cfg, 50)
    assert line is not None and line.startswith("lr schedule re-derived: total steps 100 -> 200;")
    assert lr_rederived({**old, "steps": 200}, cfg, 50) is None
    assert lr_rederived({"lr": 1e-3}, cfg, 50) is None  # an older checkpoint: not recorded
    both = lr_rederived({**old, "lr": 2e-3, "lr_schedule": "constant"}, cfg, 50)
    assert both is not None and "peak lr 0.002 -> 0.001, schedule constant -> cosine" in both


def test_stages_in_words() -> None:
    plan = straight_plan(8, [0, 3, 6], global_batch_size=4, num_micro_batches=2)
    assert stages_text(plan, 1) == "stage 1 (layers 3-5)"
    assert stages_text(straight_plan(4, [0, 3], global_batch_size=4, num_micro_batches=2), 1) == (
        "stage 1 (layer 3)"
    )


# -- weights loaded ---------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(rw.IN, rw.HID)
        self.blocks = nn.ModuleList(nn.Linear(rw.HID, rw.HID) for _ in range(2))
        self.out = nn.Linear(rw.HID, rw.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)  # type: ignore[no-any-return]


def _traced(tmp: Path) -> tuple[Any, Path]:
    wl = workload_from_module(_Net, rw._mlp_batch, nn.functional.mse_loss)
    path = tmp / "weights.pt"
    torch.save(_Net().state_dict(), path)
    return with_weights(wl, path), path


def test_loaded_tensors_per_stage(tmp_path: Path) -> None:
    wl, path = _traced(tmp_path)
    n = wl.num_layers
    total = len(_Net().state_dict())
    first, rest = loaded_tensors(wl, 0, 1), loaded_tensors(wl, 1, n)
    assert first is not None and rest is not None and first[0] == rest[0] == path.resolve()
    assert first[1] >= 2 and first[1] + rest[1] == total  # nothing tied: each tensor once
    assert loaded_tensors(workload_from_module(_Net, rw._mlp_batch, nn.functional.mse_loss),
                          0, n) is None  # fmt: skip
    assert loaded_tensors(rw.mlp(), 0, 4) is None  # not traced


def test_weights_loaded_line(
    one_rank: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl, path = _traced(tmp_path)
    train(_plan(wl.num_layers), wl, TrainConfig(steps=1, echo=True))
    lines = _lines(capsys.readouterr().out, "weights loaded:")
    total = len(_Net().state_dict())
    assert lines == [f"weights loaded: {path.resolve()}: tensors per stage: stage 0 {total}"]


# -- the launcher (real processes) -----------------------------------------------------------
def _dapple(args: list[str], env_extra: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "dapple", *args], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_standalone_start_up_phases_and_weights_of_each_stage(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from hf_dirs import save_llama

    llama = save_llama(tmp_path / "llama")
    plan = tmp_path / "plan.json"
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(plan)
    proc = _dapple(["train", "--plan", str(plan), "-m", f"hf:{llama}", "--weights", str(llama),
                    "--set", "seq=8", "--steps", "1", "--timeout-s", "120"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    phases = [line for line in out if line.startswith("start-up: ")]
    # the workers start first, then load the model while the launcher loads it and checks
    assert phases[:2] == [
        "start-up: starting 2 processes",
        f"start-up: loading the model hf:{llama}",
    ]
    assert sorted(phases[2:4]) == ["start-up: checks done, the run goes to the 2 processes",
                                   "start-up: loading the model in each of 2 processes"]  # fmt: skip
    assert phases[4] == "start-up: rendezvous"
    assert sorted(phases[5:7]) == ["start-up: building stage 0 (layers 0-1)",
                                   "start-up: building stage 1 (layers 2-3)"]  # fmt: skip
    assert phases[7:] == ["start-up: probing the stage boundaries",
                          "start-up: process groups and optimizer",
                          "start-up: first step (step 0)"]  # fmt: skip
    (weights,) = [line for line in out if line.startswith("weights loaded:")]
    head, _, counts = weights.partition(": tensors per stage: ")
    assert head == f"weights loaded: {llama.resolve()}", weights  # the path as --weights names it
    per_stage = [int(part.split()[-1]) for part in counts.split(", ")]
    assert [part.split()[:2] for part in counts.split(", ")] == [["stage", "0"], ["stage", "1"]]
    assert all(n > 0 for n in per_stage)
    assert out.index(weights) < out.index("start-up: first step (step 0)")


def _marked(mark: str) -> list[int]:
    """Processes whose environment holds ``mark`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_a_bad_input_ends_the_early_workers_without_a_word(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    straight_plan(3, [0, 2], global_batch_size=4, num_micro_batches=2).save(plan)  # mlp has 4
    mark = f"DAPPLE_TEST_MARK={os.getpid()}-{tmp_path.name}"
    proc = _dapple(["train", "--plan", str(plan), "-m", "runtime_workloads:mlp"],
                   {"DAPPLE_TEST_MARK": mark.partition("=")[2]})  # fmt: skip
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dapple: error: "), proc.stderr
    assert proc.stdout.splitlines()[:2] == [
        "start-up: starting 2 processes",
        "start-up: loading the model runtime_workloads:mlp",
    ]
    assert "start-up: rendezvous" not in proc.stdout
    assert _marked(mark) == []  # the launcher reaped its early workers before it ended


def _session_worker(rank: int, world: int, out: str) -> None:
    Path(out, f"rank{rank}").write_text(f"{os.getsid(0)} {os.getpgrp()} {os.getppid()}")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "setsid"), reason="POSIX sessions")
@pytest.mark.parametrize("shared", [False, True])
def test_spawned_workers_run_in_sessions_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    from dapple.runtime import spawn

    if shared:
        monkeypatch.setenv(SHARED_SESSION_ENV, "1")
    else:
        monkeypatch.delenv(SHARED_SESSION_ENV, raising=False)
    spawn(_session_worker, 2, str(tmp_path), timeout_s=60)
    for r in range(2):
        sid, pgrp, parent = map(int, (tmp_path / f"rank{r}").read_text().split())
        assert parent == os.getpid()  # still the launcher's child (it ends them)
        if shared:
            assert (sid, pgrp) == (os.getsid(0), os.getpgrp())
        else:
            assert sid != os.getsid(0) and pgrp != os.getpgrp()
