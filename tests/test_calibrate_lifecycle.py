"""Calibration's worker processes, on Linux, with real processes: ``dapple calibrate`` starts
them with :func:`dapple.runtime.spawn`, so

- every socket they listen on is bound to loopback, and gloo talks over loopback;
- SIGKILL, SIGTERM or SIGINT to the calibrating process leaves no worker behind.

Each test runs ``dapple calibrate`` with so many repeats that it is still measuring when the
test looks at it, finds its processes through ``/proc`` (the helpers of
``test_launcher_lifecycle``), polls with generous deadlines and ends what it started, by pid.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dapple.api.profiling import MAX_RUNS
from test_launcher_lifecycle import (
    DEADLINE_S,
    START_S,
    Launched,
    _is_loopback,
    _routed_interface,
    _tcp_sockets,
    _wait_for,
    linux_only,
)

pytestmark = [pytest.mark.slow, linux_only]

NPROC = 2
REPEATS = MAX_RUNS  # the most calibrate takes: at the default 16 MiB largest message it
# measures for over a minute on 2 cores (83 s here), longer than a test waits


class _Calibration(Launched):
    """A ``dapple calibrate`` subprocess that measures far longer than any test waits."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        argv = ["calibrate", "--nproc", str(NPROC), "-o", str(tmp / "cluster.json"),
                "--repeats", str(REPEATS)]  # fmt: skip
        super().__init__(tmp, argv, NPROC, env)

    def measuring(self) -> list[int]:
        """The workers once every one of them listens and is connected to a peer (the gloo
        group is up: they are measuring); [] before."""
        workers = self.workers()
        for pid in workers:
            states = {st for st, _, _, _ in _tcp_sockets(pid)}
            if not {"0A", "01"} <= states:
                return []
        return workers

    def wait_measuring(self) -> list[int]:
        return list(_wait_for("measuring workers", self.measuring, START_S, self.proc))


@pytest.fixture
def calibration(tmp_path: Path) -> Iterator[Callable[..., _Calibration]]:
    runs: list[_Calibration] = []

    def make(env: dict[str, str] | None = None) -> _Calibration:
        d = tmp_path / f"run{len(runs)}"
        d.mkdir()
        runs.append(_Calibration(d, env))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def test_calibration_workers_listen_and_talk_on_loopback_only(calibration) -> None:
    # even when the environment points gloo at a routed interface, calibration stays on loopback
    iface = _routed_interface()
    run = calibration(env={"GLOO_SOCKET_IFNAME": iface} if iface else None)
    workers = run.wait_measuring()
    socks = {pid: _tcp_sockets(pid) for pid in [run.proc.pid, *workers]}
    listening = [
        (pid, ip, port) for pid, ss in socks.items() for st, ip, port, _ in ss if st == "0A"
    ]
    # rank 0 serves the store and gloo's device; every worker listens for its gloo pairs
    assert set(workers) <= {pid for pid, _, _ in listening}, socks
    assert len(listening) >= len(workers) + 1, socks
    bad = [(pid, str(ip), port) for pid, ip, port in listening if not _is_loopback(ip)]
    assert not bad, f"listening beyond loopback (ss -ltnp would show *:PORT or an address): {bad}"
    talking = [(pid, ip, peer) for pid in workers for st, ip, _, peer in socks[pid] if st == "01"]
    assert {pid for pid, _, _ in talking} == set(workers), socks
    assert all(_is_loopback(ip) and _is_loopback(peer) for _, ip, peer in talking), talking


def test_sigkill_of_the_calibrating_process_ends_every_worker(calibration) -> None:
    run = calibration()
    workers = run.wait_measuring()
    assert len(workers) == NPROC and len(run.seen) >= NPROC
    os.kill(run.proc.pid, signal.SIGKILL)
    assert run.proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL
    run.assert_all_end()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_stop_the_workers_then_the_calibration(calibration, sig) -> None:
    run = calibration()
    run.wait_measuring()
    os.kill(run.proc.pid, sig)
    rc = run.proc.wait(timeout=DEADLINE_S)
    run.assert_all_end()  # multiprocessing's resource tracker too: its warnings are written
    assert "leaked semaphore" not in run.err.read_text()  # the results come back on a pipe
    if sig == signal.SIGTERM:
        assert rc == -signal.SIGTERM  # the launcher still dies of it, after its workers
    else:
        assert rc == 130 and run.err.read_text().splitlines()[-1:] == ["dapple: interrupted"]
    assert not (run.out.parent / "cluster.json").exists()
