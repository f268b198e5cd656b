"""Issue 47 (third re-run): what a new user was still misled by - a tensor group of devices
that are not consecutive drawn and named as if they were, and the training bar's ETA that stood
still between steps - and what the hostile battery still found."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from dapple.cli import main
from dapple.core.plan import Plan
from dapple.core.stage_plan import StagePlan
from dapple.runtime.reporting import ProgressBar, eta_text
from dapple.runtime.step_metrics import StepMetrics
from dapple.simulate import simulate
from dapple.simulate.trace import to_chrome_trace
from test_tensor_plan import _blocks, _cluster


# -- a tensor group is named by its own devices -------------------------------------------------
def _strided_tp_plan() -> Plan:
    """Stage 0 on 4 devices, TP2 x 2 replicas whose tensor groups are (0, 2) and (1, 3)."""
    return Plan(planner="manual", global_batch_size=4, micro_batch_size=2, num_micro_batches=2,
                stages=(StagePlan(layers=(0, 1), devices=(0, 2, 1, 3), tensor_width=2),
                        StagePlan(layers=(1, 2), devices=(4, 5))))  # fmt: skip


def test_a_tensor_group_of_strided_devices_is_named_by_them() -> None:
    r = simulate(_strided_tp_plan(), _blocks(2), _cluster())
    assert [(d.devices_text, d.stage, d.replica) for d in r.devices] == [
        ("0,2", 0, 0), ("1,3", 0, 1), ("4", 1, 0), ("5", 1, 1)]  # fmt: skip
    assert [d.devices for d in r.devices] == [(0, 2), (1, 3), (4,), (5,)]
    assert [d.tensor_width for d in r.devices] == [2, 2, 1, 1]


def test_the_trace_names_every_device_of_a_tensor_group() -> None:
    r = simulate(_strided_tp_plan(), _blocks(2), _cluster())
    events = to_chrome_trace(r)["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert names == ["devices 0,2 (TP2, stage 0, replica 0)",
                     "devices 1,3 (TP2, stage 0, replica 1)",
                     "device 4 (stage 1, replica 0)", "device 5 (stage 1, replica 1)"]  # fmt: skip
    json.dumps(events)  # still plain JSON


def test_simulate_names_an_over_memory_tensor_group_by_its_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, cluster, plan = tmp_path / "p.json", tmp_path / "c.json", tmp_path / "plan.json"
    _blocks(2).save(prof)
    dataclasses.replace(_cluster(), device_memory_bytes=1, reserved_memory_bytes=0).save(cluster)
    _strided_tp_plan().save(plan)
    assert main(["simulate", "--plan", str(plan), "--profile", str(prof),
                 "--cluster", str(cluster)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    (warning,) = [line for line in out.splitlines() if "peak memory exceeds" in line]
    assert warning.endswith("on device(s) 0,2; 1,3; 4; 5")


# -- the training bar's ETA ---------------------------------------------------------------------
def test_eta_is_the_mean_step_so_far_times_the_steps_left() -> None:
    assert eta_text(None, 0, 10) == "-:--:--"
    assert eta_text(5.0, 0, 10) == "-:--:--"  # no step ended yet: unknown, not zero
    assert eta_text(10.0, 2, 3) == "0:00:15"
    assert eta_text(10.0, 2, 0) == "0:00:00"
    assert eta_text(3600.0, 1, 2) == "2:00:00"


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=1.0, step_ms=1.0, samples_per_s=1.0,
                       peak_memory_bytes=(0,), memory_kind="held_activations")  # fmt: skip


def _eta_on_screen(bar: ProgressBar) -> str:
    """The ETA column as the bar draws it now."""
    con = Console(file=io.StringIO(), width=200, color_system=None)
    progress = bar._progress
    con.print(progress.make_tasks_table(progress.tasks))
    text = con.file.getvalue()  # type: ignore[attr-defined]
    return text.split("ETA")[1].split()[0]


def test_the_training_bars_eta_moves_with_the_clock_between_steps() -> None:
    now = [0.0]
    con = Console(file=io.StringIO(), force_terminal=True, width=200)
    bar = ProgressBar(5, start=1, console=con, clock=lambda: now[0])  # resumed after step 0
    try:
        assert _eta_on_screen(bar) == "-:--:--"
        now[0] = 4.0
        bar(_metrics(1))  # 1 step run in 4 s (the resumed one not counted), 3 left
        assert _eta_on_screen(bar) == "0:00:12"
        now[0] = 10.0  # no step ended: the mean per step grew with the clock
        assert _eta_on_screen(bar) == "0:00:30"
        now[0] = 12.0
        bar(_metrics(3))  # 3 steps in 12 s, 1 left
        assert _eta_on_screen(bar) == "0:00:04"
    finally:
        bar.close()


# -- process counts: bounded by what each process holds at the least --------------------------
def test_local_processes_are_bounded_by_their_least_memory() -> None:
    from dapple.errors import ValidationError
    from dapple.profiler.host_fit import (
        FORKED_PROCESS_BYTES,
        SPAWNED_PROCESS_BYTES,
        check_local_processes,
    )

    gib = 2**30
    check_local_processes(8, "--nproc 8", available=8 * SPAWNED_PROCESS_BYTES)  # just fits
    with pytest.raises(ValidationError, match=r"--nproc 9: 9 local processes .* at most 8 fit"):
        check_local_processes(9, "--nproc 9", available=8 * SPAWNED_PROCESS_BYTES)
    check_local_processes(4 * gib // FORKED_PROCESS_BYTES, "x", forked=True, available=4 * gib)
    with pytest.raises(ValidationError, match="32 MiB each"):
        check_local_processes(10**6, "--co-workers", forked=True, available=4 * gib)


@pytest.mark.parametrize(
    ("argv", "work", "n"),
    [
        (["calibrate", "--nproc", "1000", "-o", "{tmp}/c.json"],
         "dapple.calibrate.machine.calibrate", "1,000"),
        (["profile", "-m", "mlp", "--device", "cpu", "--co-workers", "5000", "-o",
          "{tmp}/p.json"], "dapple.profiler.measure.profile_workload", "4,999"),
        (["plan-local", "-m", "mlp", "--global-batch-size", "4", "--nprocs", "2,1000",
          "--out-dir", "{tmp}/pl"], "dapple.calibrate.local.plan_local", "1,000"),
        (["demo", "--nproc", "1000", "--out-dir", "{tmp}/demo"],
         "dapple.cli.demo_cmd._profile_and_calibrate", "1,000"),
    ],
)  # fmt: skip
def test_more_local_processes_than_fit_are_refused_before_any_starts(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    work: str,
    n: str,
) -> None:
    """8 GiB available: the model (an MLP of 122 kB) fits in every process, the processes
    themselves do not (each holds 128 MiB spawned, 32 MiB forked at the least)."""
    from builders import boom

    monkeypatch.setattr("dapple.profiler.host_fit.available_host_bytes", lambda: 8 * 2**30)
    monkeypatch.setattr(work, boom)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dapple: error: --") and err.count("\n") == 1, err
    assert f": {n} local processes need at least " in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


# -- the demo starts over in its --out-dir/checkpoints: only what dapple wrote goes -------------
def test_demo_refuses_an_out_dir_whose_checkpoints_hold_a_users_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from builders import boom

    monkeypatch.setattr("dapple.cli._demo_corpus.stdlib_sources", boom)
    mine = tmp_path / "demo" / "checkpoints" / "step-00000004"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    assert main(["demo", "--out-dir", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dapple: error: checkpoint directory ") and err.count("\n") == 1, err
    assert "'notes.txt'" in err and "give the demo another --out-dir" in err
    assert (mine / "notes.txt").read_text() == "precious"


def test_demo_train_deletes_only_the_checkpoints_a_save_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from dapple.cli import demo_cmd

    ckpt = tmp_path / "checkpoints"
    own, users = ckpt / "step-00000002", ckpt / "mine"
    own.mkdir(parents=True)
    (own / "manifest.json").write_text("{}")
    users.mkdir()
    (users / "notes.txt").write_text("precious")
    (ckpt / "README").write_text("precious")

    class _Started(Exception):
        pass

    def train(*_: object, **__: object) -> None:
        raise _Started

    monkeypatch.setattr("dapple.api.train", train)
    args = argparse.Namespace(steps=2, model="transformer")
    with pytest.raises(_Started):
        demo_cmd._train(Console(file=io.StringIO()), args, tmp_path, _strided_tp_plan(), 1.0,
                        {}, None, [0] * 8, 1.0)  # fmt: skip
    assert not own.exists()  # the earlier run's own checkpoint
    assert (users / "notes.txt").read_text() == "precious"
    assert (ckpt / "README").read_text() == "precious"


# -- a launcher killed while its spawned workers still import leaves none behind --------------
_LAUNCHER = """
import os, sys
sys.path.insert(0, {tests!r})
if __name__ == "__main__":  # (a spawned process imports this file too, as __mp_main__)
    import slow_import_helper
    from dapple.runtime.launch.launcher import spawn
    os.environ["DAPPLE_TEST_IMPORT_S"] = "60"  # the worker's import of the helper: 60 s
    spawn(slow_import_helper.idle, 1)
"""


@pytest.mark.slow
def test_a_launcher_killed_during_its_workers_imports_leaves_none_behind(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER.format(tests=str(Path(__file__).parent)))
    env = {k: v for k, v in os.environ.items() if k != "DAPPLE_TEST_IMPORT_S"}
    launcher = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        workers: list[int] = []
        deadline = time.monotonic() + 120.0
        while not workers and time.monotonic() < deadline:
            time.sleep(0.5)
            workers = _spawned_children(launcher.pid)
        assert workers, "no worker started"
        time.sleep(2.0)  # the worker is in its imports (60 s)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(map(_alive, workers)):
            time.sleep(0.2)
        assert not any(map(_alive, workers)), "a worker outlived its killed launcher"
    finally:
        launcher.kill()
        for pid in _spawned_children(launcher.pid):
            os.kill(pid, signal.SIGKILL)


def _spawned_children(parent: int) -> list[int]:
    """The multiprocessing-spawned children of ``parent`` (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmd:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, reaped by init soon, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# -- generate and profile: bad prompt bytes, seeds, threads and batches in one line -------------
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--prompt", "a\udce9b"], "--prompt is not UTF-8 text: byte 0xe9 at character 1"),
        (["--prompt", "hi", "--seed", str(10**23)],
         f"--seed must be an integer from {-(2**63)} to {2**63 - 1}, got {10**23}"),
        (["--prompt", "hi", "--seed", str(-(2**63) - 1)], f"got {-(2**63) - 1}"),
    ]
)  # fmt: skip
def test_generate_refuses_a_prompt_of_bad_bytes_and_a_seed_torch_cannot_take(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    needle: str,
) -> None:
    from builders import boom, one_error_line

    monkeypatch.setattr("dapple.api.generate", boom)
    monkeypatch.setattr("dapple.runtime.export.newest_checkpoint", boom)
    argv = ["generate", "--checkpoint-dir", str(tmp_path), "-m", "transformer", *extra]
    assert main(argv) == 2
    one_error_line(capsys, needle)


def test_profile_refuses_more_threads_than_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from builders import boom, one_error_line
    from dapple.host.cpu_cores import usable_cores

    monkeypatch.setattr("dapple.profiler.measure.profile_workload", boom)
    argv = ["profile", "-m", "mlp", "--device", "cpu", "-o", str(tmp_path / "p.json")]
    assert main([*argv, "--threads", str(usable_cores() + 1)]) == 2
    one_error_line(capsys, f"--threads must be from 1 to the {usable_cores()} usable cores")
    assert list(tmp_path.iterdir()) == []


def test_profile_out_of_host_memory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from builders import one_error_line

    def alloc(*_: object, **__: object) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 26400000000 bytes.\nError code 12"
        )

    monkeypatch.setattr("dapple.profiler.measure.profile_workload", alloc)
    # past the up-front host-memory check whatever this machine has free at the time
    monkeypatch.setattr("dapple.profiler.host_fit.available_host_bytes", lambda: 2**60)
    argv = ["profile", "-m", "mlp", "--device", "cpu", "--batch-sizes", "100000000", "-o",
            str(tmp_path / "p.json")]  # fmt: skip
    assert main(argv) == 2
    err = one_error_line(capsys, "profiling at --batch-sizes 100000000 ran out of host memory")
    assert "26400000000 bytes. Error code 12)" in err and "give smaller batch sizes" in err
    assert list(tmp_path.iterdir()) == []


# -- a SIGKILLed torchrun leaves no rank training ------------------------------------------------
_AGENT = """
import os, subprocess, sys
env = {**os.environ, "TORCHELASTIC_RUN_ID": "t"}
code = ("import sys, time; from dapple.cli import end_with_torchrun_agent as e; e(); "
        "open(sys.argv[1], 'w').close(); time.sleep(60)")
rank = subprocess.Popen([sys.executable, "-c", code, sys.argv[1]], env=env)
print(rank.pid, flush=True)
rank.wait()
"""


def test_a_rank_ends_with_its_killed_torchrun_agent(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    armed = tmp_path / "armed"
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, str(armed)], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert agent.stdout is not None
        rank = int(agent.stdout.readline())
        deadline = time.monotonic() + 120.0
        while not armed.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert armed.exists() and _alive(rank)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _alive(rank):
            time.sleep(0.2)
        assert not _alive(rank), "the rank outlived its killed agent"
    finally:
        agent.kill()


def test_train_refuses_a_seed_torch_cannot_take() -> None:
    from dapple.errors import ValidationError
    from dapple.runtime.train_config import TrainConfig

    TrainConfig(steps=3, seed=2**63 - 4)  # the last step's batch seed is 2^63 - 1
    TrainConfig(steps=3, seed=-(2**63))
    with pytest.raises(ValidationError, match=r"seed must be an integer from .* got 10{23}"):
        TrainConfig(steps=3, seed=10**23)  # was torch's "Overflow when unpacking long long"
    with pytest.raises(ValidationError, match="to 9223372036854775804"):
        TrainConfig(steps=3, seed=2**63 - 3)


def test_demo_refuses_a_global_batch_larger_than_its_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from builders import boom, one_error_line

    monkeypatch.setattr("dapple.cli._demo_corpus.stdlib_sources", boom)
    argv = ["demo", "--out-dir", str(tmp_path / "d"), "--corpus-mib", "1", "--seq-len", "64"]
    assert main([*argv, "--global-batch-size", "1000000000"]) == 2  # planned 31 days a step
    one_error_line(capsys, "--global-batch-size 1000000000 x --seq-len 64 needs 64,000,000,001 "
                   "tokens, more than the 1,048,576 tokens (bytes) of --corpus-mib 1")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_train_refuses_a_plan_of_more_local_processes_than_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standalone ``train`` starts one process per plan device: a plan of 5 devices with room
    for 4 processes (each holds 128 MiB at the least) is refused before any starts."""
    from builders import boom
    from dapple.core.plan import straight_plan
    from dapple.profiler.host_fit import SPAWNED_PROCESS_BYTES

    plan = tmp_path / "plan.json"
    straight_plan(5, [0, 1, 2, 3, 4], global_batch_size=8, num_micro_batches=2).save(plan)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(
        "dapple.profiler.host_fit.available_host_bytes", lambda: 4 * SPAWNED_PROCESS_BYTES
    )
    monkeypatch.setattr("dapple.runtime.launch.early.EarlyWorkers", boom)
    assert main(["train", "--plan", str(plan), "-m", "mlp", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dapple: error: --plan of 5 devices") and err.count("\n") == 1, err
    assert ": 5 local processes need at least " in err and "at most 4 fit" in err, err


def test_start_up_lines_count_one_process_as_one() -> None:
    from dapple.runtime.launch.local import processes_text

    assert processes_text(1) == "the process"
    assert processes_text(1, "the") == "the process"
    assert processes_text(4) == "each of 4 processes"
    assert processes_text(4, "the") == "the 4 processes"
