"""Resident memory in the step metrics: per stage, max over replicas, beside what it was before."""

from __future__ import annotations

import mmap

import torch

from dapple.core.plan import straight_plan
from dapple.runtime.metrics import resident_bytes, step_metrics

MIB = 2**20


def test_step_metrics_takes_each_stages_worst_replica() -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=6, num_micro_batches=2, replicas=[2, 1])
    # [kind, stage, micro-batch, rank, loss part, held peak, peak resident, resident before]
    rows = [
        [-1, 0, -1, 0, 0.0, 5 * MIB, 400 * MIB, 300 * MIB],
        [-1, 0, -1, 1, 0.0, 6 * MIB, 390 * MIB, 250 * MIB],
        [-1, 1, -1, 2, 1.5, 2 * MIB, 350 * MIB, 320 * MIB],
        [-1, -1, -1, 3, 0.0, 0, 900 * MIB, 0],  # a rank beyond the plan: not a stage
    ]
    m = step_metrics(plan, 3, rows, 100.0, "held_activations", None, "VmHWM")
    assert m.peak_memory_bytes == (6 * MIB, 2 * MIB)
    assert m.peak_resident_bytes == (400 * MIB, 350 * MIB)
    assert m.stage_resident_bytes == (140 * MIB, 30 * MIB)  # replica 1 of stage 0 grew most
    assert m.resident_kind == "VmHWM"
    assert "peak[VmHWM] s0=400.0MiB s1=350.0MiB" in m.line()
    short = step_metrics(plan, 3, [r[:6] for r in rows], 100.0, "held_activations", None)
    assert short.peak_resident_bytes == () and "VmHWM" not in short.line()


def test_resident_bytes_sees_an_allocation() -> None:
    """A fresh anonymous mapping, every page written: resident whatever the allocator kept
    from earlier tests (a torch tensor may reuse pages already resident)."""
    cpu = torch.device("cpu")
    before = resident_bytes(cpu, peak=False)
    block = mmap.mmap(-1, 64 * MIB)
    for page in range(0, 64 * MIB, 4096):  # 64 MiB, every page touched
        block[page] = 1
    after = resident_bytes(cpu, peak=False)
    assert after - before > 48 * MIB
    assert resident_bytes(cpu, peak=True) >= after
    block.close()


_CHILD = """
import mmap, os, resource, torch
from dapple.runtime.metrics import PeakResident, resident_bytes
cpu = torch.device("cpu")
reads = []
pread = os.pread
os.pread = lambda *a: reads.append(a) or pread(*a)
probe = PeakResident()
hwm = resident_bytes(cpu, peak=True) // 1024
assert probe._floor_kib > hwm, (probe._floor_kib, hwm)  # the launcher's peak is inherited
reads.clear()
for _ in range(3):  # hidden by the inherited peak: every reading from the file
    assert probe() == resident_bytes(cpu, peak=True)
assert len(reads) == 6, len(reads)
grow = (probe._floor_kib - hwm) * 1024 + 64 * 2**20
block = mmap.mmap(-1, grow)
for page in range(0, grow, 4096):
    block[page] = 1
assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > probe._floor_kib
got = probe()  # ru_maxrss moved: read from the file
assert abs(got - resident_bytes(cpu, peak=True)) < 2**20 and got > grow
reads.clear()
assert [probe() for _ in range(100)] == [got] * 100  # no growth: read once at most
assert len(reads) <= 1, len(reads)
print("ok")
"""


def test_peak_resident_reads_the_file_only_when_the_peak_moved() -> None:
    """``VmHWM`` in this process, read from the file again only once ``getrusage``'s peak
    moved; in a process started by a larger one (as a launcher starts its workers), which
    inherits that peak in ``ru_maxrss``, from the file at every reading until its own peak
    passes the inherited one."""
    import subprocess
    import sys

    from dapple.runtime.metrics import PeakResident

    cpu = torch.device("cpu")
    probe = PeakResident()
    first = probe()
    assert abs(first - resident_bytes(cpu, peak=True)) < 2**20
    big = 384 * MIB  # this process's size, inherited by the child, above the child's own peak
    block = mmap.mmap(-1, big)
    for page in range(0, big, 4096):
        block[page] = 1
    assert abs(probe() - resident_bytes(cpu, peak=True)) < 2**20  # read again if it moved
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                             check=False, timeout=120)  # fmt: skip
    finally:
        block.close()
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
