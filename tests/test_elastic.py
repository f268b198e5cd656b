"""Elastic runs (:mod:`dapple.runtime.launch.elastic`): the re-plan logic on its own, then real
runs - a worker killed with SIGKILL mid-run and the run finishing on the survivors with the
losses of an uninterrupted run; the minimum-device stop leaving a checkpoint that resumes; a
``torchrun`` job growing from one node to two and re-planning for the larger set."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from builders import make_profile
from dapple.core.cluster_presets import PRESETS
from dapple.core.device_kinds import DeviceKind
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.runtime.checkpoint import latest_checkpoint
from dapple.runtime.launch.elastic import (
    ElasticPolicy,
    ElasticStop,
    cluster_of,
    metrics_lines,
    plan_for_world,
    train_elastic,
    worker_plan,
)
from dapple.runtime.launch.failure import RankFailure
from dapple.runtime.train_config import TrainConfig

CPU = PRESETS["local-cpu"]


def _profile() -> ModelProfile:
    return make_profile(5, name="mlp")


def _policy(**kw: Any) -> ElasticPolicy:
    return ElasticPolicy(_profile(), CPU, **kw)


def _plan31() -> Plan:
    return straight_plan(5, [0, 2], global_batch_size=16, num_micro_batches=2, replicas=[3, 1])


# -- the logic on its own ----------------------------------------------------------------------
def test_lost_ranks_are_those_killed_by_a_signal() -> None:
    f = RankFailure("4 of 4 workers failed", {0: 1, 1: -9, 2: 1, 3: None})
    assert f.lost_ranks() == (1,)  # exit 1: lost a peer; None: hung; -9: the lost device
    assert RankFailure("in a rank").lost_ranks() == ()


def test_cluster_of_keeps_whole_servers() -> None:
    assert cluster_of(CPU, 3).num_devices == 3
    eight = dataclasses.replace(CPU, servers=2, devices_per_server=4)
    assert (cluster_of(eight, 7).servers, cluster_of(eight, 7).devices_per_server) == (1, 4)
    with pytest.raises(ElasticStop, match="fewer than one server of 4"):
        cluster_of(eight, 3)


def test_policy_and_options_are_checked_before_any_run() -> None:
    with pytest.raises(ValidationError, match="min_devices must be an integer >= 1, got 0"):
        _policy(min_devices=0)
    with pytest.raises(ValidationError, match="give it checkpoint_dir and save_every"):
        train_elastic(_plan31(), TrainConfig(steps=3), lambda p, c: None, policy=_policy())


def test_plan_for_world_keeps_a_plan_that_fits_and_replans_otherwise() -> None:
    plan = _plan31()
    assert plan_for_world(plan, 4, _policy()) is plan
    two = plan_for_world(plan, 2, _policy())
    assert len(two.devices) <= 2 and two.global_batch_size == 16
    with pytest.raises(ElasticStop, match="2 devices, fewer than the minimum 3"):
        plan_for_world(plan, 2, _policy(min_devices=3))


class _Attempts:
    """A stand-in launcher: each call fails as listed (exit codes by rank) or succeeds."""

    def __init__(self, ck: Path, fails: list[dict[int, int | None]]) -> None:
        self.ck, self.fails, self.plans = ck, fails, []  # type: ignore[var-annotated]

    def __call__(self, plan: Plan, config: TrainConfig) -> None:
        self.plans.append((plan, config))
        if self.fails:
            raise RankFailure("workers failed", self.fails.pop(0))


def _config(tmp_path: Path, steps: int = 3) -> TrainConfig:
    return TrainConfig(steps=steps, checkpoint_dir=str(tmp_path / "ck"), save_every=1,
                       metrics_path=str(tmp_path / "m.jsonl"))  # fmt: skip


def test_a_lost_device_replans_for_the_survivors_and_resumes(tmp_path: Path) -> None:
    attempts = _Attempts(tmp_path, [{0: 1, 1: 1, 2: -9, 3: 1}])
    (tmp_path / "m.jsonl").write_text("")
    result = train_elastic(_plan31(), _config(tmp_path), attempts, policy=_policy())
    assert len(attempts.plans) == 2
    (first, o1), (second, o2) = attempts.plans
    assert first == _plan31() and not o1.resume
    assert len(second.devices) <= 3 and o2.resume and not o2.overwrite_checkpoints
    assert [r.lost for r in result.replans] == [(2,)] and result.plan == second
    _, events = metrics_lines(tmp_path / "m.jsonl")
    assert [e["lost_ranks"] for e in events] == [[2]]
    assert events[0]["old_plan"] == first.to_dict() and events[0]["new_plan"] == second.to_dict()


def test_an_error_of_the_run_is_not_a_lost_device(tmp_path: Path) -> None:
    attempts = _Attempts(tmp_path, [{0: 1, 1: 1, 2: 1, 3: 1}])
    with pytest.raises(RankFailure, match="workers failed"):
        train_elastic(_plan31(), _config(tmp_path), attempts, policy=_policy())
    assert len(attempts.plans) == 1


def test_limits_stop_the_run(tmp_path: Path) -> None:
    lost = {0: 1, 1: -9, 2: 1, 3: 1}
    with pytest.raises(ElasticStop, match="3 devices left, fewer than the minimum 4"):
        train_elastic(_plan31(), _config(tmp_path), _Attempts(tmp_path, [lost]),
                      policy=_policy(min_devices=4))  # fmt: skip
    again = [lost, {0: -9, 1: 1}, {0: -9}]
    with pytest.raises(ElasticStop, match=r"1 re-plans made, the most allowed \(max_restarts=1\)"):
        train_elastic(_plan31(), _config(tmp_path), _Attempts(tmp_path, again),
                      policy=_policy(max_restarts=1))  # fmt: skip


def test_a_torchrun_worker_resumes_and_records_a_changed_plan(tmp_path: Path) -> None:
    plan, config = worker_plan(_plan31(), 4, _policy(), _config(tmp_path), announce_it=True)
    assert plan == _plan31() and config.resume  # no checkpoint yet: nothing recorded
    assert not (tmp_path / "m.jsonl").exists()


# -- real runs ---------------------------------------------------------------------------------
_SCRIPT = """
import json, sys
from dapple.core.cluster_presets import PRESETS
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.runtime.launch.elastic import ElasticPolicy
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.launch.launcher import train

if __name__ == "__main__":
    out, plan_file, steps, min_devices = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    policy = ElasticPolicy(ModelProfile.load(f"{out}/profile.json"), PRESETS["local-cpu"],
                           min_devices=min_devices, max_restarts=2)
    cfg = TrainConfig(steps=steps, checkpoint_dir=f"{out}/ck", save_every=1,
                      metrics_path=f"{out}/m.jsonl", echo=True, optimizer="adamw", lr=1e-2,
                      seed=5, device="cpu", timeout_s=60)
    train(Plan.load(plan_file), "mlp", cfg, elastic=policy)
"""


def _workers(pid: int) -> list[int]:
    """The launcher's worker processes (its children running multiprocessing's spawn_main)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout  # fmt: skip
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def _steps_seen(metrics: Path) -> int:
    try:
        return sum('"step"' in line for line in metrics.read_text().splitlines())
    except FileNotFoundError:
        return 0


def _wait_for(what: str, ok: Any, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def _start(
    tmp_path: Path, plan: Plan, steps: int, min_devices: int, cli: bool = False
) -> subprocess.Popen[str]:
    """The elastic run as a script calling the API, or (``cli``) as ``dapple train --elastic``."""
    _profile().save(tmp_path / "profile.json")
    plan.save(tmp_path / "plan.json")
    (tmp_path / "run.py").write_text(textwrap.dedent(_SCRIPT))
    cmd = [sys.executable, str(tmp_path / "run.py"), str(tmp_path), str(tmp_path / "plan.json"),
           str(steps), str(min_devices)]  # fmt: skip
    if cli:
        cmd = [sys.executable, "-m", "dapple", "train", "--plan", "plan.json", "-m", "mlp",
               "--steps", str(steps), "--checkpoint-dir", "ck", "--save-every", "1",
               "--metrics", "m.jsonl", "--optimizer", "adamw", "--lr", "1e-2", "--seed", "5",
               "--device", "cpu", "--timeout-s", "60", "--keep", "0", "--elastic",
               "--profile", "profile.json", "--cluster", "local-cpu",
               "--min-devices", str(min_devices), "--max-restarts", "2"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": _pythonpath()})  # fmt: skip


def _pythonpath() -> str:
    tests = str(Path(__file__).parent)
    return os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)


def _kill_worker(tmp_path: Path, proc: subprocess.Popen[str], at_step: int, index: int) -> None:
    """SIGKILL the ``index``-th worker (by pid order) once ``at_step`` steps are recorded."""
    _wait_for(f"step {at_step}", lambda: _steps_seen(tmp_path / "m.jsonl") >= at_step, proc)
    workers = sorted(_workers(proc.pid))
    assert len(workers) == 4
    os.kill(workers[index], signal.SIGKILL)


def _reference_losses(steps: int, optimizer: str = "adamw") -> list[float]:
    from dapple import api

    one = straight_plan(5, [0], global_batch_size=16, num_micro_batches=2)
    ms = api.train(one, "mlp", steps, optimizer=optimizer, lr=1e-2, seed=5, device="cpu")
    return [m.loss for m in ms]


def _last_loss_per_step(metrics: Path) -> dict[int, float]:
    records, _ = metrics_lines(metrics)
    return {r["step"]: r["loss"] for r in records}  # a re-run step: its last record


STEPS = 30  # long enough to kill a worker mid-run: a step takes tens of ms


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_worker_costs_a_replan_and_the_run_finishes_on_the_survivors(
    tmp_path: Path,
) -> None:
    proc = _start(tmp_path, _plan31(), STEPS, min_devices=1, cli=True)
    try:
        _kill_worker(tmp_path, proc, at_step=3, index=2)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "re-plan: replication 3:1 on 4 devices (M=2) -> " in out, out[-3000:]
    _, events = metrics_lines(tmp_path / "m.jsonl")
    assert len(events) == 1 and len(events[0]["lost_ranks"]) == 1, events
    # the loss is said once, as such; the survivors' ends are its consequence, not errors
    assert f"lost rank {events[0]['lost_ranks'][0]}, re-planning for the 3 devices left" in out
    assert "dapple: error:" not in err, err[-3000:]
    assert "the run re-planned once; its last plan: replication " in out, out[-3000:]
    # the kill lands once step 3's metrics line is out, before or after step 3's save
    assert events[0]["resume_step"] >= 2
    losses = _last_loss_per_step(tmp_path / "m.jsonl")
    assert sorted(losses) == list(range(STEPS))
    ref = _reference_losses(STEPS)
    assert [losses[i] for i in range(STEPS)] == pytest.approx(ref, rel=1e-5)
    last = latest_checkpoint(tmp_path / "ck")
    assert last is not None and last.meta.step == STEPS


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_below_the_minimum_the_run_stops_with_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    proc = _start(tmp_path, _plan31(), STEPS, min_devices=4)
    try:
        _kill_worker(tmp_path, proc, at_step=2, index=1)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "3 devices left, fewer than the minimum 4" in err, err[-3000:]
    ck = latest_checkpoint(tmp_path / "ck")
    assert ck is not None and ck.meta.step >= 2
    from dapple import api

    two = straight_plan(5, [0, 2], global_batch_size=16, num_micro_batches=2)
    api.train(two, "mlp", STEPS, optimizer="adamw", lr=1e-2, seed=5, device="cpu",
              checkpoint_dir=str(tmp_path / "ck"), save_every=1, resume=True,
              metrics_path=str(tmp_path / "m.jsonl"))  # fmt: skip
    losses = _last_loss_per_step(tmp_path / "m.jsonl")
    assert [losses[i] for i in range(STEPS)] == pytest.approx(_reference_losses(STEPS), rel=1e-5)


_TORCHRUN_SCRIPT = """
import sys
from dapple.core.cluster_presets import PRESETS
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.runtime.launch.elastic import ElasticPolicy
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.launch.launcher import train

if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    policy = ElasticPolicy(ModelProfile.load(f"{out}/profile.json"), PRESETS["local-cpu"])
    cfg = TrainConfig(steps=steps, checkpoint_dir=f"{out}/ck", save_every=1,
                      metrics_path=f"{out}/m.jsonl", echo=True, optimizer="sgd", lr=1e-2,
                      seed=5, device="cpu", timeout_s=60)
    train(Plan.load(f"{out}/plan.json"), "mlp", cfg, elastic=policy)
"""
# SGD: over hundreds of steps AdamW's normalised updates amplify rounding differences between
# plans (they sum gradients in another order) into visible loss differences.


def _agent(tmp_path: Path, port: int, steps: int, name: str) -> subprocess.Popen[str]:
    """One ``torchrun`` node agent of a job of 1 to 2 nodes, one worker each."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=grow",
           "--rdzv-conf=last_call_timeout=1", "--max-restarts=3", str(tmp_path / "run.py"),
           str(tmp_path), str(steps)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the test's tmp dir
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip


GROW_STEPS = 400  # the second node joins while the first trains alone: a step takes ~20 ms


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_torchrun_job_grows_back_and_replans_for_the_larger_set(tmp_path: Path) -> None:
    from dapple.runtime.launch.launcher import free_port

    _profile().save(tmp_path / "profile.json")
    straight_plan(5, [0, 2], global_batch_size=16, num_micro_batches=2).save(tmp_path / "plan.json")
    (tmp_path / "run.py").write_text(textwrap.dedent(_TORCHRUN_SCRIPT))
    port = free_port()
    first = _agent(tmp_path, port, GROW_STEPS, "a")
    second = None
    try:
        _wait_for("the first node's step 5", lambda: _steps_seen(tmp_path / "m.jsonl") >= 5, first)
        second = _agent(tmp_path, port, GROW_STEPS, "b")
        assert first.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert second.wait(timeout=120) == 0, (tmp_path / "b.log").read_text()[-3000:]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
    _, events = metrics_lines(tmp_path / "m.jsonl")
    grown = [e for e in events if len(Plan.from_dict(e["new_plan"]).devices) == 2]
    assert grown and len(Plan.from_dict(grown[0]["old_plan"]).devices) == 1, events
    assert 5 <= grown[0]["resume_step"] < GROW_STEPS, "the node joined after the run ended"
    losses = _last_loss_per_step(tmp_path / "m.jsonl")
    assert sorted(losses) == list(range(GROW_STEPS))
    ref = _reference_losses(GROW_STEPS, "sgd")
    assert [losses[i] for i in range(GROW_STEPS)] == pytest.approx(ref, rel=1e-5)


def test_the_cli_asks_for_what_a_replan_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapple.cli import main

    _plan31().save(tmp_path / "plan.json")
    base = ["train", "--plan", str(tmp_path / "plan.json"), "-m", "mlp", "--elastic"]
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dapple: error: --elastic goes on from the newest checkpoint when a device is "
                   "lost: give --checkpoint-dir DIR and --save-every N (N >= 1; got "
                   "--checkpoint-dir (none), --save-every (none))"]  # fmt: skip
    saves = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "1"]
    assert main([*base, *saves]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dapple: error: --elastic re-plans with the planner: give profile and "
                   "cluster (--profile, --cluster)"]  # fmt: skip
    given = ["--profile", "prof.json", "--cluster", "local-cpu", "--min-devices", "2", *saves]
    assert main([*base, *given, "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "[elastic]\nelastic = true\nmin_devices = 2\nmax_restarts = 3" in out


@pytest.mark.parametrize(("restarts_done", "closing"), [(0, "rank 1 stops"), (3, "error: ")])
def test_a_torchrun_survivor_of_a_lost_peer_says_so_while_torchrun_restarts(
    restarts_done: int, closing: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Under torchrun with restarts left, a rank whose peer is gone prints what happens next,
    not an error; with none left it is the run's error."""
    from dapple.runtime.launch import launcher

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_RESTART_COUNT": str(restarts_done), "TORCHELASTIC_MAX_RESTARTS": "3"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def lost(*_: Any) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")

    def die(msg: str, kind: str = "error: ") -> None:
        raise SystemExit(f"dapple: {kind}{msg}")

    monkeypatch.setattr(launcher, "_elastic_worker", lambda plan, policy, config: (plan, config))
    monkeypatch.setattr(launcher, "init_distributed", lost)
    monkeypatch.setattr(launcher, "_die", die)
    plan = straight_plan(5, [0, 2], global_batch_size=4, num_micro_batches=2)
    with pytest.raises(SystemExit) as stop:
        launcher.train(plan, "mlp", _config(tmp_path, steps=2), elastic=_policy())
    line = str(stop.value)
    assert line.startswith(f"dapple: {closing}"), line
    assert "Connection closed by peer" in line
    assert ("torchrun restarts the workers and dapple re-plans" in line) == (restarts_done == 0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_on_two_kinds_with_their_profiles_replans_on_the_kind_left(tmp_path: Path) -> None:
    """``train --elastic`` on a cluster of two kinds (2 servers of 2), each with its own
    profile (``--profile H=... --profile A=...``): rank 0, an H device, is killed; the run
    re-plans on the A server alone (devices 2, 3 of the first plan) and its losses are those
    of one uninterrupted device."""
    h = _profile()
    a = dataclasses.replace(h, layers=tuple(
        dataclasses.replace(x, forward=dataclasses.replace(x.forward, per_sample_ms=4 * x.forward.per_sample_ms))
        for x in h.layers))  # fmt: skip
    h.save(tmp_path / "h.json")
    a.save(tmp_path / "a.json")
    cluster = dataclasses.replace(CPU, servers=2, devices_per_server=2, kinds=(
        DeviceKind(name="H", servers=1, device_memory_bytes=CPU.device_memory_bytes),
        DeviceKind(name="A", servers=1, device_memory_bytes=CPU.device_memory_bytes)))  # fmt: skip
    cluster.save(tmp_path / "kinds.json")
    _plan31().save(tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "dapple", "train", "--plan", "plan.json", "-m", "mlp",
           "--steps", str(STEPS), "--checkpoint-dir", "ck", "--save-every", "1",
           "--metrics", "m.jsonl", "--optimizer", "adamw", "--lr", "1e-2", "--seed", "5",
           "--device", "cpu", "--timeout-s", "60", "--keep", "0", "--elastic",
           "--profile", "H=h.json", "--profile", "A=a.json", "--cluster", "kinds.json",
           "--max-restarts", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": _pythonpath()})  # fmt: skip
    try:
        _kill_worker(tmp_path, proc, at_step=3, index=0)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    _, events = metrics_lines(tmp_path / "m.jsonl")
    assert len(events) == 1 and events[0]["lost_ranks"] == [0], events
    assert "lost rank 0, re-planning for the 2 devices left" in out, out[-3000:]  # 1 idle
    assert len(Plan.from_dict(events[0]["new_plan"]).devices) <= 2  # the A server's two
    losses = _last_loss_per_step(tmp_path / "m.jsonl")
    assert sorted(losses) == list(range(STEPS))
    assert [losses[i] for i in range(STEPS)] == pytest.approx(_reference_losses(STEPS), rel=1e-5)
