"""``dapple train`` end to end: standalone launch, metrics file, validation and a killed rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import runtime_workloads as rw
from builders import make_profile
from dapple.core.plan import straight_plan

TESTS = Path(__file__).parent


def _dapple(args: list[str], env_extra: dict[str, str] | None = None, timeout: float = 120):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dapple", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


@pytest.mark.slow
def test_train_standalone_matches_reference_and_prints_prediction(tmp_path: Path) -> None:
    plan = straight_plan(
        4, [0, 1, 3], global_batch_size=10, num_micro_batches=2, replicas=[2, 1, 1]
    )
    plan.save(tmp_path / "p.json")
    make_profile(n=4).save(tmp_path / "prof.json")
    proc, _ = _dapple(
        [
            "train", "--plan", str(tmp_path / "p.json"), "--model", "runtime_workloads:tuple_chain",
            "--steps", "3", "--seed", "2", "--optimizer", "adam", "--lr", "0.01",
            "--metrics", str(tmp_path / "m.jsonl"), "--timeout-s", "60",
            "--profile", str(tmp_path / "prof.json"), "--cluster", "local-cpu",
        ]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    _, ref_losses = rw.reference_run(rw.tuple_chain(), "adam", 0.01, 2, 10, 3)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(ref_losses))
    assert all(len(r["peak_memory_bytes"]) == 3 and min(r["peak_memory_bytes"]) > 0 for r in rows)
    assert all(r["predicted_step_ms"] > 0 for r in rows)
    # resident memory per stage: the process's VmHWM, and what building and training added
    assert all(r["resident_kind"] == "VmHWM" for r in rows)
    assert all(len(r["peak_resident_bytes"]) == 3 for r in rows)
    assert all(p > 50 * 2**20 for r in rows for p in r["peak_resident_bytes"])  # torch alone
    grown, peaks = rows[-1]["stage_resident_bytes"], rows[-1]["peak_resident_bytes"]
    assert len(grown) == 3 and all(0 <= g < p for g, p in zip(grown, peaks, strict=True))
    out = proc.stdout.splitlines()
    assert sum(line.startswith("step ") for line in out) == 3
    measured = next(line for line in out if line.startswith("measured step time"))
    assert "vs predicted" in measured and "(simulator)" in measured
    assert out[out.index(measured) + 1].startswith("the prediction rests on the profile")
    # then each stage's memory beside the planner's estimate
    table = "\n".join(out[out.index(measured) + 1 :])
    assert "planner" in table and "estimate" in table and "VmHWM" in table


def test_train_rejects_layer_mismatch_before_launch(tmp_path: Path) -> None:
    straight_plan(3, [0, 1], global_batch_size=4, num_micro_batches=2).save(tmp_path / "p.json")
    proc, _ = _dapple(
        ["train", "--plan", str(tmp_path / "p.json"), "--model", "runtime_workloads:mlp"]
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dapple: error: plan covers layers [0, 3) but the model has 4 layers"
    ]


@pytest.mark.slow
def test_killed_rank_makes_every_other_rank_fail_fast(tmp_path: Path) -> None:
    plan = straight_plan(4, [0, 2, 3], global_batch_size=8, num_micro_batches=4, replicas=[2, 1, 1])
    plan.save(tmp_path / "p.json")
    timeout_s = 20
    proc, elapsed = _dapple(
        ["train", "--plan", str(tmp_path / "p.json"), "--model", "runtime_workloads:mlp",
         "--steps", "3", "--timeout-s", str(timeout_s)],
        env_extra={"DAPPLE_TEST_FAIL_RANK": "2", "DAPPLE_TEST_FAIL_STEP": "1"},
    )  # fmt: skip
    assert proc.returncode != 0
    err = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr
    for rank in (0, 1, 3):
        mine = [e for e in err if e.startswith(f"dapple: error: step 1: rank {rank} (stage")]
        assert len(mine) == 1, proc.stderr
    # the direct neighbours name the lost peer
    assert any("lost peer rank 2 (stage 1 replica 0)" in e for e in err), proc.stderr
    assert err[-1] == (
        "dapple: error: 4 of 4 workers failed: rank 0 exit 1, rank 1 exit 1, rank 2 exit 1, "
        "rank 3 exit 1"
    )
    assert elapsed < timeout_s + 30  # process start-up + the timeout bound; no hang
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps[0].startswith("step 0 ")  # step 0 completed before the failure


@pytest.mark.slow
def test_train_zoo_model(tmp_path: Path) -> None:
    zoo = pytest.importorskip("dapple.models.zoo")
    wl = zoo.load_workload("mlp")
    n = wl.num_layers
    straight_plan(n, [0, n // 2], global_batch_size=8, num_micro_batches=4).save(
        tmp_path / "p.json"
    )
    proc, _ = _dapple(
        ["train", "--plan", str(tmp_path / "p.json"), "--model", "mlp", "--steps", "3"]
    )
    assert proc.returncode == 0, proc.stderr
    assert sum(line.startswith("step ") for line in proc.stdout.splitlines()) == 3


@pytest.mark.slow
def test_train_under_torchrun_with_recompute(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to the interpreter")
    from dapple.runtime import free_port

    straight_plan(4, [0, 2], global_batch_size=9, num_micro_batches=3, replicas=[1, 2]).save(
        tmp_path / "p.json"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "3", "--master-port", str(free_port()),
         "-m", "dapple", "train", "--plan", str(tmp_path / "p.json"),
         "--model", "runtime_workloads:mlp", "--steps", "2", "--recompute", "full", "--lr", "0.1",
         "--metrics", str(tmp_path / "m.jsonl"), "--timeout-s", "60"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    _, ref = rw.reference_run(rw.mlp(), "sgd", 0.1, 0, 9, 2)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(ref))
    assert sum(line.startswith("step ") for line in proc.stdout.splitlines()) == 2  # rank 0 only
