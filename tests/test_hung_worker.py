"""A frozen worker (SIGSTOP) is a lost device, found by its missing heartbeat within the timeout.

Before: its peers waited for it until their own collective timeout, the launcher then waited
``timeout_s + GRACE_S`` more before killing it as "hung" (about 52 s at ``--timeout-s 20``), and
an elastic run stopped instead of re-planning, since a hung rank did not count as lost.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import pytest

from dapple.runtime.launch.failure import RankFailure
from dapple.runtime.launch.launcher import spawn
from dapple.runtime.launch.local import heartbeats, silent_ranks

TIMEOUT_S = 8.0


def _freeze_rank_1(rank: int, world: int) -> None:
    """Both ranks meet once; then rank 1 stops itself and rank 0 waits for it."""
    import torch.distributed as dist

    from dapple.runtime import TrainConfig, init_distributed

    init_distributed(TrainConfig(timeout_s=TIMEOUT_S, device="cpu"), world)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP and PDEATHSIG")
def test_a_frozen_worker_is_killed_as_a_lost_device() -> None:
    with pytest.raises(RankFailure) as info:
        spawn(_freeze_rank_1, 2, timeout_s=TIMEOUT_S)
    failure = info.value
    assert failure.exit_codes[1] == -signal.SIGKILL
    assert failure.lost_ranks() == (1,)  # an elastic run re-plans without it
    assert "rank 1 stopped responding (no heartbeat for 8 s" in str(failure)


class _Proc:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


def test_silent_ranks_are_live_workers_that_beat_and_stopped() -> None:
    import time

    beats: Any = heartbeats(4)
    now = time.monotonic()
    beats[0] = now  # beating
    beats[1] = now - 100  # silent
    beats[2] = 0.0  # not started beating yet (still importing): never silent
    beats[3] = now - 100  # silent but already ended: nothing to kill
    procs = [_Proc(True), _Proc(True), _Proc(True), _Proc(False)]
    assert silent_ranks(procs, beats, 10.0) == [1]
    assert silent_ranks(procs, None, 10.0) == []
