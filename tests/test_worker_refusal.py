"""A worker's refusal after the rendezvous ends a local launch in one ``dapple: error:`` line
(:mod:`dapple.runtime.launch.refusal`): no lost-peer lines from the other ranks, no gloo C++
trace, exit 2, no process left. The same under ``torchrun`` (the agent's store counts the
refusals) and in ``dapple calibrate``'s workers."""

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


# -- under torchrun: the agent's store counts the refusals ----------------------------------------
_REFUSE = """
import sys
from dapple.errors import ValidationError
from dapple.runtime.launch.refusal import end_refused, refused_elsewhere
print(refused_elsewhere(), flush=True)
end_refused(ValidationError(sys.argv[1]))
"""


def _refuse(env: dict[str, str], text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _REFUSE, text], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


def test_under_torchrun_the_first_refusal_is_the_jobs_one_line() -> None:
    """Two ranks refuse in turn with the agent's store up: the first writes its line, the
    second sees that a rank refused and ends without one; both exit 2."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port), "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
    runs = [_refuse(env, f"refused by rank {r}") for r in (1, 0)]
    assert [r.returncode for r in runs] == [2, 2]
    assert [r.stdout for r in runs] == ["False\n", "True\n"]
    assert [r.stderr for r in runs] == ["dapple: error: refused by rank 1\n", ""]
    # a restart's attempt counts anew
    env["TORCHELASTIC_RESTART_COUNT"] = "1"
    again = _refuse(env, "again")
    assert (again.stdout, again.stderr) == ("False\n", "dapple: error: again\n")


_END = """
import sys
from dapple.errors import ValidationError
from dapple.runtime.launch.refusal import end_if_refused
end_if_refused(ValidationError(sys.argv[1]) if sys.argv[1] else RuntimeError("peer closed"))
print("returned", flush=True)
"""


@pytest.mark.slow
def test_under_torchrun_each_node_writes_the_jobs_line_once(tmp_path: Path) -> None:
    """A rank of node 1 refuses; the ranks that lose their peer to it end with exit 2, the
    first of each node where no rank wrote the line writing the refusal's; every ending rank
    leaves the line in torch's error file, which torch's own reader shows; an attempt without
    a refusal returns."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    base = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port), "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
    line = "dapple: error: layer 3 cannot be built on rank 1"
    said = []
    for i, (node, text) in enumerate(
        [("1", "layer 3 cannot be built on rank 1"), ("0", ""), ("0", ""), ("1", "")]
    ):
        err = tmp_path / f"error-{i}.json"
        env = {**base, "GROUP_RANK": node, "TORCHELASTIC_ERROR_FILE": str(err)}
        done = subprocess.run([sys.executable, "-c", _END, text], env=env, capture_output=True,
                              text=True, timeout=120, check=False)  # fmt: skip
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        said.append(done.stderr)
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(err))
        assert failure.message == line
    assert said == [f"{line}\n", f"{line}\n", "", ""]
    base["TORCHELASTIC_RESTART_COUNT"] = "1"  # a new attempt, no refusal in it: a plain failure
    done = subprocess.run([sys.executable, "-c", _END, ""], env=base, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "returned\n", "")


def _torchrun(tmp_path: Path, model: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(tmp_path / "p.json")
    env = {**os.environ, **env}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "0", "-m", "dapple", "train", "--plan", str(tmp_path / "p.json"),
           "-m", model, "--steps", "2", "--timeout-s", "60"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "env", "line"),
    [
        ("runtime_workloads:refusing_mlp", {}, "layer 3 cannot be built on rank 1"),
        ("runtime_workloads:mlp", {"DAPPLE_SLOWDOWN": "x"}, "DAPPLE_SLOWDOWN='x': 'x' is not"),
    ],
    ids=["one rank after the rendezvous", "every rank before it"],
)
def test_a_refusal_under_torchrun_is_the_jobs_one_line(
    tmp_path: Path, model: str, env: dict[str, str], line: str
) -> None:
    done = _torchrun(tmp_path, model, env)
    assert done.returncode != 0
    ours = [x for x in done.stderr.splitlines() if x.startswith("dapple:")]
    assert len(ours) == 1 and ours[0].startswith(f"dapple: error: {line}"), done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr  # the refusing rank's exit code, as torchrun reports it
    # torchrun's own summary follows; its root cause is dapple's line (torch's error file)
    assert f"traceback : dapple: error: {line}" in done.stderr, done.stderr[-3000:]
    assert "To enable traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_one_line_on_each_node(tmp_path: Path) -> None:
    """Two torchrun agents on this machine as the two nodes of one job (one worker each):
    rank 1 (node 1) refuses after the rendezvous, rank 0 (node 0) loses its peer to it; each
    agent's output holds the refusal's one line."""
    from dapple.runtime import free_port

    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(tmp_path / "p.json")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    port = str(free_port())

    def agent(node: int) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
               str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
               port, "--max-restarts", "0", "-m", "dapple", "train", "--plan",
               str(tmp_path / "p.json"), "-m", "runtime_workloads:refusing_mlp", "--steps", "2",
               "--timeout-s", "60"]  # fmt: skip
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip

    agents = [agent(0), agent(1)]
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=300)[1])
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    for node, err in enumerate(outs):
        ours = [x for x in err.splitlines() if x.startswith("dapple:")]
        assert ours == ["dapple: error: layer 3 cannot be built on rank 1"], (node, err[-3000:])


# -- calibrate's workers ---------------------------------------------------------------------------
def test_calibrate_refuses_a_bad_slowdown_before_any_process(monkeypatch) -> None:
    from dapple.calibrate import machine
    from dapple.runtime.launch import launcher

    def no_spawn(*_a: object, **_k: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launcher, "spawn", no_spawn)
    monkeypatch.setattr(machine, "_matmul_alone_ms", no_spawn)
    monkeypatch.setenv("DAPPLE_SLOWDOWN", "1:0")
    with pytest.raises(ValidationError, match=r"DAPPLE_SLOWDOWN='1:0'"):
        machine.calibrate(nproc=2, sizes=(1024, 2048), repeats=1)


@pytest.mark.slow
def test_a_refusal_in_calibrates_workers_is_raised_once_without_a_traceback(
    monkeypatch, capfd
) -> None:
    """The workers' tiny runtime runs refuse (the variable set only once the launcher's own
    check is passed): the launcher raises the refusal; no worker prints a traceback or a line."""
    import multiprocessing as mp

    from dapple.calibrate import machine
    from dapple.runtime.launch.launcher import spawn

    monkeypatch.setenv("DAPPLE_SLOWDOWN", "x")
    results, sender = mp.get_context("spawn").Pipe(duplex=False)
    with pytest.raises(ValidationError, match=r"DAPPLE_SLOWDOWN='x'"):
        spawn(machine._worker, 2, (16384, 32768), 1, sender, timeout_s=120)
    sender.close()
    results.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "dapple: error" not in err, err[-3000:]
