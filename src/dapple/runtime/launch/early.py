"""Workers started before their run is known, so that the launcher's work and theirs overlap.

A standalone ``dapple train`` loads (and traces) the model in the launcher to check the plan
against it before any compute, and every worker loads it again to build its stage. Done one
after the other, the launcher's load, the workers' start (a new session, the runtime's imports)
and their load add up; ``torchrun`` has no launcher-side load at all. :class:`EarlyWorkers`
starts the workers first thing: each takes its own session (:mod:`dapple.host.own_session`),
binds its life to the launcher's, loads the model from its spec and then waits for its run on
a pipe, while the launcher loads the model and checks the plan, the data and the checkpoints.

- :func:`dapple.runtime.launch.launcher.spawn` (``early=``) hands each worker ``fn`` and its
  arguments; a worker whose run names the model it loaded uses it (:func:`preloaded`), any
  other loads the run's model itself.
- :meth:`EarlyWorkers.close` ends workers that never got a run (a bad input: the launcher
  prints its one line, the workers go without a word).
- Nothing a worker does before its run has effects: no process group, no file; a load that
  fails is forgotten (the launcher's own load names the error; a run loads again).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from types import TracebackType
from typing import Any

import torch.multiprocessing as mp

from dapple.host.own_session import Deferred, run_in_own_session
from dapple.log_lines import use_log_lines
from dapple.models.workload import Workload
from dapple.runtime.launch.local import (
    end_with_launcher,
    heartbeats,
    listener,
    processes_text,
    run_worker,
    start_heartbeat,
    stop_workers,
)
from dapple.runtime.launch.refusal import refusal_folder
from dapple.runtime.metrics import announce

__all__ = ["EarlyWorkers", "preloaded"]

log = logging.getLogger(__name__)

_preloaded: tuple[bytes, Workload] | None = None
"""In an early worker: the model it loaded, with its pickle (the spec it loads from)."""


class EarlyWorkers:
    """``nprocs`` local workers that load the model ``spec`` (with ``overrides``, as
    :func:`dapple.models.spec.load` takes them) and wait for their run (see the module
    docstring). A context manager: leaving it ends those still waiting.

    Attributes:
        procs: the worker processes, rank by rank.
    """

    def __init__(
        self, nprocs: int, spec: str, overrides: Mapping[str, Any], *, echo: bool = False
    ) -> None:
        """Start the workers (saying ``start-up: starting N processes`` with ``echo``)."""
        announce(f"start-up: starting {nprocs} process{'es' if nprocs != 1 else ''}", echo)
        ctx = mp.get_context("spawn")  # the launcher itself is each worker's parent
        sock = listener()  # rank 0's store address, bound before any worker looks for it
        port, me = int(sock.getsockname()[1]), os.getpid()
        self.nprocs = nprocs
        self.beats = heartbeats(nprocs)  # each worker's heartbeat, read by the launcher
        self.refusals = refusal_folder()  # a worker's refusal, read by the launcher
        self.procs: list[Any] = []
        self._runs: list[Connection] = []  # the launcher's end of each worker's pipe
        try:
            for r in range(nprocs):
                wait_end, run_end = ctx.Pipe(duplex=False)
                p = ctx.Process(target=run_in_own_session,
                                args=(Deferred(_early_worker, r, nprocs, port, me,
                                               sock if r == 0 else None, wait_end, spec,
                                               dict(overrides), echo, self.beats,
                                               self.refusals), me))  # fmt: skip
                self._runs.append(run_end)
                self.procs.append(p)
                p.start()
                wait_end.close()
        except BaseException:
            self.close()
            raise
        finally:
            sock.close()  # rank 0 holds its copy

    def hand(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Give every worker its run, ``fn(rank, world, *args)``. Sent from a thread per worker
        (a worker still loading reads it later; one that died is reported by its exit code)."""
        run = bytes(ForkingPickler.dumps((fn, args)))
        runs, self._runs = self._runs, []
        for conn in runs:
            threading.Thread(target=_send, args=(conn, run), daemon=True).start()

    def close(self) -> None:
        """End the workers still waiting for a run (or running: stopped as
        :func:`dapple.runtime.launch.local.stop_workers` does); reap them all."""
        for conn in self._runs:
            conn.close()
        self._runs = []
        stop_workers(self.procs)
        shutil.rmtree(self.refusals, ignore_errors=True)

    def __enter__(self) -> EarlyWorkers:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.close()


def _send(conn: Connection, run: bytes) -> None:
    try:
        conn.send_bytes(run)
    except OSError:  # the worker is gone: its exit code says why
        pass
    finally:
        conn.close()


def _early_worker(
    rank: int,
    world: int,
    port: int,
    launcher: int,
    sock: Any,
    wait_end: Connection,
    spec: str,
    overrides: dict[str, Any],
    echo: bool,
    beats: Any = None,
    refusals: str | None = None,
) -> None:
    """An early worker: end with the launcher, beat
    (:func:`~dapple.runtime.launch.local.heartbeats`), load the model, wait for the run and run
    it; its warnings are ``dapple: warning:`` lines (:func:`~dapple.log_lines.use_log_lines`)."""
    end_with_launcher(launcher)
    use_log_lines()
    start_heartbeat(beats, rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the launcher stops the workers
    if rank == 0:
        announce(f"start-up: loading the model in {processes_text(world)}", echo)
    _preload(spec, overrides)
    try:
        fn, args = ForkingPickler.loads(wait_end.recv_bytes())
    except EOFError:  # closed without a run: the launcher stopped (a bad input)
        os._exit(0)
    wait_end.close()
    run_worker(fn, rank, world, port, launcher, sock, args, beats=None, refusals=refusals)


def _preload(spec: str, overrides: dict[str, Any]) -> None:
    global _preloaded
    from dapple.models.spec import load

    try:
        wl = load(spec, **overrides)
        _preloaded = (pickle.dumps(wl), wl)
    except Exception as e:  # the launcher's own load names it; a run loads again
        log.debug("early load of %s failed: %s", spec, e)


def preloaded(payload: bytes) -> Workload | None:
    """The workload this worker loaded before its run when ``payload`` (the run's workload,
    pickled: a spec and its overrides) is that one; None otherwise (or not an early worker)."""
    if _preloaded is not None and _preloaded[0] == payload:
        return _preloaded[1]
    return None
