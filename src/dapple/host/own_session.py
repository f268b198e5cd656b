"""A spawned worker's first step: a session of its own, before anything heavy is imported.

Linux schedules by session when ``kernel.sched_autogroup_enabled`` is 1 (the default of many
distributions): every session gets an equal share of the CPU, however many processes it runs.
Workers left in their launcher's session share one slot between them; ``torchrun`` starts each
of its workers in a new session (``start_new_session=True``), so on a machine busy with other
sessions its ranks get one share each. :func:`run_in_own_session` gives a standalone launch's
workers the same footing, as their first act - their imports (torch) and tracing already run in
the new session. The launcher stays in charge of their lives (:mod:`dapple.runtime.launch.local`):
they end when it ends (bound here, before their imports), it stops them on SIGTERM and SIGINT;
terminal signals (Ctrl-C, Ctrl-Z) reach only the launcher.

Torch-free on purpose: a spawned worker unpickles its target before it can call it, so the
target must live in a module that imports nothing heavy, and the real call travels as bytes
(:class:`Deferred`) that are unpickled only after :func:`os.setsid`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from dapple.host.parent_death import end_with_parent

__all__ = ["SHARED_SESSION_ENV", "Deferred", "run_in_own_session"]

SHARED_SESSION_ENV = "DAPPLE_SHARED_SESSION"
"""``1``: spawned workers stay in their launcher's session (one CPU share between them on a
busy machine, as before; their launcher's terminal signals reach them too)."""


class Deferred:
    """``fn(*args)`` to run in a spawned worker, pickled as bytes when the worker process
    starts (``multiprocessing``'s pickler, so sockets and shared tensors among ``args`` pass as
    they would as direct arguments) and unpickled by :func:`run_in_own_session`."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.call = (fn, args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (bytes, (bytes(ForkingPickler.dumps(self.call)),))


def run_in_own_session(call: bytes, launcher: int | None = None) -> None:
    """In a spawned worker: end with ``launcher`` (its pid, taken before the worker started;
    :func:`dapple.host.parent_death.end_with_parent`) from now on, so that a launcher killed
    while the worker still imports leaves nothing behind; start a new session (see the module
    docstring; not with ``DAPPLE_SHARED_SESSION=1``, nor where sessions cannot be made); then
    unpickle and run the :class:`Deferred` call."""
    if launcher is not None:
        end_with_parent(launcher)
    if os.environ.get(SHARED_SESSION_ENV) != "1" and hasattr(os, "setsid"):
        with contextlib.suppress(PermissionError):  # a process group leader keeps its session
            os.setsid()
    fn, args = ForkingPickler.loads(call)
    fn(*args)
