"""A helper process's parent-death guard: a forked helper ends when its parent ends, however
the parent ends (SIGKILL included, where no cleanup code of the parent runs).

Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` - the kernel kills the helper when the thread that
forked it exits. Everywhere (and as a second line on Linux, should ``prctl`` be unavailable or
the forking thread outlive its process in some odd runtime): a daemon thread polls
``os.getppid()`` and ends the helper with ``os._exit`` once it no longer matches. If the parent
ended before the guard was armed (the helper was re-parented already), the helper exits at once.
Pure ``os``/``ctypes``, no torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["POLL_S", "end_with_parent"]

POLL_S = 0.5
"""Seconds between two ``getppid`` checks of the fallback watcher."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _set_pdeathsig() -> bool:
    """Ask the kernel to SIGKILL this process when its parent (thread) exits; True if armed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):  # no libc symbol: rely on the watcher
        return False


def _watch(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(1)


def end_with_parent(parent: int, *, poll_s: float = POLL_S) -> bool:
    """Make this (forked) process end when the process ``parent`` ends.

    Call it first thing in the helper, with the parent's pid taken *before* the fork.

    Args:
        parent: the pid of the process that started this one.
        poll_s: seconds between the watcher thread's ``getppid`` checks.

    Returns:
        True if the kernel guard (``PR_SET_PDEATHSIG``) is armed; the polling watcher runs
        either way.
    """
    armed = _set_pdeathsig()
    threading.Thread(target=_watch, args=(parent, poll_s), daemon=True, name="parent-watch").start()
    if os.getppid() != parent:  # the parent died before the guard was armed
        os._exit(1)
    return armed
