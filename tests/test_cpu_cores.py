"""CPU thread counts from the granted cores, and CPU-time profiles of one thread.

The failure these guard against (first run on dedicated cores: 4 workers on 12 of 16 cores,
cost model 15-30x above the measured step): the runtime and the calibration sized each
worker's intra-op threads by ``os.cpu_count()`` (16 // 4 = 4 threads on 3 cores each, so every
OpenMP region waited for a descheduled thread), and co-worker profiles timed the *process's*
CPU time, which sums every thread's CPU, spinning ones included. On a 2-core machine both
show by granting the process fewer cores than the host has, and by a second thread burning CPU
while the timed call waits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from dapple.calibrate.machine import runtime_threads
from dapple.host.cpu_cores import threads_per_worker, usable_cores
from dapple.profiler.layer_measure import Timer

needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
    reason="needs Linux CPU affinity and at least 2 cores",
)


def test_threads_follow_the_granted_cores_not_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # 12 of a 16-core host granted: 4 workers get 3 threads each, not 16 // 4 = 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4, 16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert usable_cores() == 12
    assert threads_per_worker(4) == 3
    assert runtime_threads(4) == 3  # the calibration and profiles use the runtime's count
    assert threads_per_worker(24) == 1  # more workers than cores: one thread each
    assert threads_per_worker(0) == 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_INIT_ONE_CORE = """
import os, sys, torch
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
from dapple.runtime import TrainConfig, init_distributed, shutdown_distributed
init_distributed(TrainConfig(timeout_s=60, device="cpu"), 1)
print(torch.get_num_threads(), len(os.sched_getaffinity(0)))
shutdown_distributed()
"""


@needs_affinity
def test_a_worker_on_one_granted_core_runs_one_thread() -> None:
    """A runtime worker restricted to one core of a multi-core host (``taskset -c 0``) runs
    one intra-op thread; sized by the host's count it ran ``cpu_count()`` threads on it."""
    env = {**os.environ, "DAPPLE_PIN_CORES": "0"}
    out = subprocess.run(
        [sys.executable, "-c", _INIT_ONE_CORE, str(_free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    threads, cores = map(int, out.stdout.split()[-2:])
    assert (threads, cores) == (1, 1), out.stdout + out.stderr


def test_cpu_time_counts_the_timed_thread_only() -> None:
    """The profiler's CPU-time clock does not charge a call for other threads' CPU: a call
    that only waits while another thread burns ~100 ms of CPU reads (almost) nothing."""
    burnt = threading.Event()

    def burn() -> None:
        a = torch.randn(128, 128)
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.1:  # CPU time of this thread, whatever the load
            a = (a @ a).tanh()
        burnt.set()

    timer = Timer(torch.device("cpu"), cpu_time=True)
    worker = threading.Thread(target=burn)
    p0 = time.process_time()
    ms, _ = timer(lambda: (worker.start(), burnt.wait(60)))
    process_ms = (time.process_time() - p0) * 1e3
    worker.join()
    assert process_ms >= 100.0  # the process did burn it (what process_time would charge)
    assert ms < 50.0, ms
