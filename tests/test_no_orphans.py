"""Forked helpers end with their parent, however it ends (issue 47, item 1).

A parent process starts the profiler's co-workers (:class:`dapple.profiler.co_workers.CoWorkers`)
and reports their pids; the test SIGKILLs (or SIGTERMs) the parent - so none of its cleanup runs -
and waits, with a generous deadline, until no co-worker is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dapple.host.parent_death import end_with_parent

DEADLINE_S = 60.0

_PARENT = textwrap.dedent(
    """
    import sys, time, torch
    from dapple.models.zoo import mlp
    from dapple.profiler.co_workers import CoWorkers
    torch.set_num_threads(1)
    load = CoWorkers(mlp(layers=2, in_features=8, hidden=16), 2, 2, 0)
    print(" ".join(str(p.pid) for p in load._procs), flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_gone(pids: list[int]) -> list[int]:
    end = time.monotonic() + DEADLINE_S
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    return left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_co_workers_end_when_their_parent_is_killed(sig: int) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()  # CoWorkers returns once every co-worker computes
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        assert all(_alive(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(timeout=DEADLINE_S)
        left = _wait_gone(pids)
        for p in left:  # do not leave them behind even when the test fails
            os.kill(p, signal.SIGKILL)
        assert left == [], f"co-workers {left} outlived their parent ({signal.Signals(sig).name})"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_end_with_parent_exits_a_helper_whose_parent_is_already_gone() -> None:
    """A helper re-parented before its guard was armed exits at once (the guard's own check)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        end_with_parent(os.getppid() + 1_000_000)  # a pid that is not our parent: "gone"
        os.write(w, b"survived")
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    got = os.read(r, 100)
    os.close(r)
    assert got == b""
    assert os.waitstatus_to_exitcode(status) == 1
