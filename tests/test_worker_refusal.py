"""A worker's refusal after the rendezvous ends a local launch in one ``dapple: error:`` line
(:mod:`dapple.runtime.launch.refusal`): no lost-peer lines from the other ranks, no gloo C++
trace, exit 2, no process left."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dapple.core.plan import straight_plan
from dapple.errors import InfeasibleError, ValidationError
from dapple.runtime.checkpoint import CheckpointError
from dapple.runtime.launch import refusal
from dapple.runtime.launch.failure import RankFailure

TESTS = Path(__file__).parent


def _marked(mark: str) -> list[int]:
    """Processes whose environment holds ``DAPPLE_TEST_MARK=mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = (entry / "environ").read_bytes()
            except OSError:
                continue
            if f"DAPPLE_TEST_MARK={mark}".encode() in env.split(b"\0"):
                found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_a_refusal_in_one_worker_is_the_runs_one_line(tmp_path: Path) -> None:
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(tmp_path / "p.json")
    mark = uuid.uuid4().hex
    env = {**os.environ, "DAPPLE_TEST_MARK": mark}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    argv = ["train", "--plan", str(tmp_path / "p.json"), "-m", "runtime_workloads:refusing_mlp",
            "--steps", "2", "--timeout-s", "60"]  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-m", "dapple", *argv], capture_output=True,
                              text=True, env=env, timeout=300)  # fmt: skip
        err = done.stderr.splitlines()
        assert done.returncode == 2, done.stderr
        assert [x for x in err if not x.startswith("start-up:")] == [
            "dapple: error: layer 3 cannot be built on rank 1"
        ], done.stderr
        assert _marked(mark) == []
    finally:
        for pid in _marked(mark):
            os.kill(pid, 9)


def test_what_counts_as_a_refusal() -> None:
    assert refusal.is_refusal(ValidationError("x"))
    assert refusal.is_refusal(CheckpointError("x"))
    assert not refusal.is_refusal(RankFailure("step 0: rank 1 failed"))
    assert not refusal.is_refusal(RuntimeError("x"))
    lost = ValidationError("x")
    lost.__cause__ = RuntimeError("Connection closed by peer [127.0.0.1]:5310")
    assert not refusal.is_refusal(lost)


def test_the_launcher_reads_the_lowest_ranks_refusal(tmp_path: Path) -> None:
    assert refusal.refused(str(tmp_path)) is None
    (tmp_path / "3.pickle").write_bytes(pickle.dumps(InfeasibleError("three")))
    (tmp_path / "1.pickle").write_bytes(pickle.dumps(CheckpointError("one")))
    (tmp_path / "0.part").write_bytes(b"half")  # not yet whole
    got = refusal.refused(str(tmp_path))
    assert isinstance(got, CheckpointError) and str(got) == "one"


def test_outside_a_local_launch_a_rank_reports_its_refusal_itself() -> None:
    refusal.set_refusal_folder(None)
    refusal.hand_over(ValidationError("x"), 0)  # returns: the caller prints its line
