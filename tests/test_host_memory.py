"""The CPU ranks' C allocator setting (:mod:`dapple.host.host_memory`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dapple.host import host_memory

# A step's pattern, five times: allocate 32 MiB of activations, free them all. Prints the
# minor page faults of the worst round (after the first, which maps the memory once).
_SCRIPT = """
import resource, sys
import torch
from dapple.host.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
worst = 0
for i in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    acts = [torch.ones(1 << 18) for _ in range(32)]  # 32 x 1 MiB
    del acts
    if i:
        worst = max(worst, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(worst)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_memory_is_reused_without_page_faults() -> None:
    # Under glibc's defaults about 4 in 5 processes fault every round (~8,000 faults: the heap
    # top is trimmed and refilled; which processes escape depends on the address layout), so a
    # no-op would fail one of three runs with probability ~0.99; with the thresholds fixed a round
    # faulted 256-1,024 times in the runs seen.
    runs = [_faults("keep") for _ in range(3)]
    assert max(runs) < 4096, runs  # half the 8,192 pages of 4 KiB that would be fresh


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.ENV, "0")
    assert host_memory.keep_freed_memory() is False
