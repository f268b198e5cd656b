"""A single-host launch beyond starting processes: workers that end with their launcher, and a
rendezvous that listens on loopback only (used by :func:`dapple.runtime.launch.launcher.spawn`).

Lifetimes. A worker starts in a session of its own (:mod:`dapple.host.own_session`: its share
of a busy machine's CPU, as a ``torchrun`` worker's; terminal signals reach only the launcher),
bound to end with the launcher before it imports anything heavy, and once its code is imported
arms :func:`end_with_launcher` as well: on Linux
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel kill it when the launcher dies - SIGKILL
included - and a ``getppid`` check closes the race where the launcher died before that. While
the launcher waits, :class:`StopSignals` notes SIGTERM and SIGINT; the launcher then stops every
worker (:func:`stop_workers`: SIGTERM, SIGKILL after :data:`STOP_GRACE_S`, reaped) and lets the
signal take its usual effect on itself.

Rendezvous. Given only a port, torch's ``TCPStore`` listens on every interface (``*:PORT``) -
an unauthenticated key-value store, beside pickle-based collectives. The launcher binds the
store's socket to ``127.0.0.1`` itself (:func:`listener`) and hands it to rank 0, whose store
serves on it (``master_listen_fd``); gloo's pair sockets follow ``GLOO_SOCKET_IFNAME``, set to
the loopback interface (:func:`loopback_interface`) whatever the host name resolves to.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as dist

from dapple.log_lines import use_log_lines
from dapple.runtime.launch.failure import RankFailure
from dapple.runtime.launch.refusal import set_refusal_folder
from dapple.runtime.launch.stop_line import RunClosing

__all__ = [
    "HEARTBEAT_S",
    "LOOPBACK",
    "PIN_CORES_ENV",
    "STOP_GRACE_S",
    "Interrupted",
    "StopSignals",
    "end_with_launcher",
    "exit_text",
    "heartbeats",
    "join_loopback",
    "listener",
    "local_store",
    "loopback_interface",
    "not_while_importing_main",
    "pin_cores",
    "processes_text",
    "run_worker",
    "shutdown_distributed",
    "silent_ranks",
    "start_heartbeat",
    "stop_workers",
]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 5.0
"""Seconds a worker has to end after the launcher's SIGTERM before it gets SIGKILL."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HEARTBEAT_S = 1.0
"""Seconds between a worker's heartbeats (:func:`heartbeats`)."""


# -- lifetimes -------------------------------------------------------------------------------
def end_with_launcher(launcher: int) -> None:
    """Make this process end when the process ``launcher`` (its parent) ends, however it ends.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` - the kernel kills this process when the thread
    that started it exits (``spawn`` waits in that thread until every worker is gone).
    Elsewhere a daemon thread polls ``getppid``. Then, if the launcher ended before that was
    armed (this process was re-parented already), exit at once.

    Raises:
        OSError: ``prctl`` failed.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    else:
        threading.Thread(target=_watch_parent, args=(launcher,), daemon=True).start()
    if os.getppid() != launcher:
        os._exit(1)


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    os._exit(1)


class Interrupted(KeyboardInterrupt):
    """SIGINT under Python's default handler, after the launcher wrote the run's closing line
    (the CLI then adds no ``dapple: interrupted`` of its own)."""


class StopSignals:
    """While the launcher waits: SIGTERM and SIGINT are only noted (``received``; the waiting
    loop then stops the workers), and on leaving they are delivered again under the handlers
    they had - so the launcher still dies of SIGTERM, raises KeyboardInterrupt on SIGINT, or
    runs its caller's handler (and if that returns, :class:`RankFailure`). Python runs signal
    handlers in the main thread only: entered in another thread this changes nothing (the
    workers still end with the launcher). A signal the process ignores stays ignored. A
    :class:`~dapple.runtime.launch.stop_line.RunClosing` around it is told that the closing
    line is written."""

    def __init__(self, closing: Callable[[str], str] | None = None) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._closing = closing
        """The run's closing line for a signal's name, written to stderr before the signal
        takes effect (None: none)."""

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous = signal.getsignal(sig)
                if previous not in (signal.SIG_IGN, None):
                    self._previous[sig] = previous
                    signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if self.received is not None:
            name = signal.Signals(self.received).name
            logger.info("%s: stopped the workers", name)
            if self._closing is not None:
                sys.stdout.flush()
                os.write(2, (self._closing(name) + "\n").encode())
                outer = self._previous.get(self.received)
                if isinstance(outer, RunClosing):
                    outer.said = True  # the run's one closing line is this one
                if self._previous.get(self.received) is signal.default_int_handler:
                    raise Interrupted(name)  # what that handler raises, closing line written
            signal.raise_signal(self.received)
            raise RankFailure(f"workers stopped by {name}")


def not_while_importing_main() -> None:
    """In a worker that is still importing the launching script (a script that trains at import
    time, without an ``if __name__ == "__main__":`` guard): say what to add, in one line, and
    end this worker instead of starting workers of its own."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.stderr.write(
            "dapple: error: this script starts dapple's worker processes when it is imported, "
            "and every worker imports it: put the calls under "
            '`if __name__ == "__main__":`\n'
        )
        sys.stderr.flush()
        os._exit(1)


def stop_workers(procs: list[Any]) -> None:
    """SIGTERM every live worker of ``procs`` (``multiprocessing.Process``), SIGKILL those still
    alive :data:`STOP_GRACE_S` later, and reap them all (never started ones are skipped)."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in started:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.kill()
        p.join()


# -- heartbeats ------------------------------------------------------------------------------
def heartbeats(n: int) -> Any:
    """Shared slots, one per worker, where each worker's heartbeat thread writes the
    ``time.monotonic()`` of its latest beat every :data:`HEARTBEAT_S` (0: no beat yet).

    A stopped or frozen worker (SIGSTOP, a debugger, a process starved of CPU for good) stops
    beating, while one merely waiting for a peer in a collective keeps beating: its waits
    release the GIL. The launcher ends a worker silent for longer than the run's timeout as a
    lost device (:func:`silent_ranks`), so peers waiting for it fail at once instead of after
    their own timeouts, and an elastic run re-plans. The slots take no lock (a worker stopped
    while holding one would block the launcher); an aligned double is written whole.
    """
    return mp.get_context("spawn").RawArray("d", n)


def _beat(beats: Any, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
        time.sleep(HEARTBEAT_S)


def start_heartbeat(beats: Any, rank: int) -> None:
    """Beat into ``beats[rank]`` from a daemon thread of this worker (nothing for None)."""
    if beats is not None:
        beats[rank] = time.monotonic()
        threading.Thread(target=_beat, args=(beats, rank), daemon=True).start()


def silent_ranks(procs: list[Any], beats: Any, after_s: float) -> list[int]:
    """Ranks of live workers that beat once and then not for more than ``after_s``."""
    if beats is None:
        return []
    now = time.monotonic()
    return [r for r, p in enumerate(procs) if p.is_alive() and 0 < beats[r] < now - after_s]


def exit_text(code: int | None) -> str:
    """A worker's end as words: ``exit 1``, ``killed by SIGKILL``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit {code}"


def run_worker(
    fn: Callable[..., None],
    rank: int,
    world: int,
    port: int,
    launcher: int,
    sock: socket.socket | None,
    args: tuple[Any, ...],
    beats: Any = None,
    refusals: str | None = None,
) -> None:
    """A spawned worker: bind its life to the launcher's, beat into ``beats`` (:func:`heartbeats`),
    hand a refusal over into the folder ``refusals`` (:mod:`dapple.runtime.launch.refusal`),
    meet the others on loopback (rank 0 serves on ``sock``), set the env and run
    ``fn(rank, world, *args)``; when ``fn`` returns with the default process group still open,
    leave it (:func:`shutdown_distributed`) before the interpreter finalizes. Its warnings are
    ``dapple: warning:`` lines, as the launcher's (:func:`~dapple.log_lines.use_log_lines`)."""
    end_with_launcher(launcher)
    use_log_lines()
    start_heartbeat(beats, rank)
    set_refusal_folder(refusals)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the launcher stops the workers
    os.environ.update(
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        **join_loopback(port, sock),
    )
    fn(rank, world, *args)
    if dist.is_initialized():
        shutdown_distributed()


def shutdown_distributed() -> None:
    """Leave the default process group: a barrier, ``destroy_process_group``, then a garbage
    collection, so every gloo group is gone while Python is still fully alive.

    Why: a gloo group's worker thread drops its last reference to a finished collective (e.g.
    an ``all_gather`` whose tensors are Python objects) on its own; if that happens while the
    interpreter is finalizing - the group kept alive by a reference cycle that only the exit-time
    collection frees - the thread needs the GIL, is told to exit, and the C++ runtime aborts the
    process ("terminate called without an active exception", SIGABRT; core dump backtrace:
    ``~AsyncAllgatherWork`` -> ``take_gil`` -> ``pthread_exit`` in ``ProcessGroupGloo::runLoop``).
    The barrier keeps a rank from tearing down while a peer is still in the last collective.
    Call it on every rank, only when the group is healthy (after a failure peers may be gone).
    """
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


# -- rendezvous ------------------------------------------------------------------------------
def listener(port: int = 0) -> socket.socket:
    """A TCP socket bound to ``127.0.0.1:port`` (0: a free port) and listening."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((LOOPBACK, port))
    s.listen(socket.SOMAXCONN)
    return s


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on BSDs); None if not found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), None)


@dataclass
class _Rendezvous:
    """The loopback port of rank 0's store and, on rank 0 until a store takes it, the socket
    the launcher bound and listens on there."""

    port: int
    listen_fd: int | None = None


_joined: _Rendezvous | None = None
"""Set by :func:`join_loopback` in a worker the launcher started; None in any other process."""


def join_loopback(port: int, sock: socket.socket | None) -> dict[str, str]:
    """In a spawned worker: meet the others at ``127.0.0.1:port`` (rank 0 passes the launcher's
    listening socket ``sock``). Returns the env to set: gloo on the loopback interface."""
    global _joined
    _joined = _Rendezvous(port)
    if sock is not None:
        _joined.listen_fd = sock.detach()
        os.set_inheritable(_joined.listen_fd, False)
    lo = loopback_interface()
    return {} if lo is None else {"GLOO_SOCKET_IFNAME": lo}


def local_store(timeout: timedelta) -> dict[str, Any] | None:
    """``init_process_group`` arguments in a worker that :func:`join_loopback`: a TCPStore on
    ``127.0.0.1`` (rank 0 serves on the launcher's socket; a second group in the same worker
    binds the port again, on loopback too) with RANK and WORLD_SIZE from the env. None in any
    other process."""
    rdv = _joined
    if rdv is None:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        fd = rdv.listen_fd if rdv.listen_fd is not None else listener(rdv.port).detach()
        rdv.listen_fd = None  # the store owns it and closes it
        store = dist.TCPStore(  # type: ignore[attr-defined]
            LOOPBACK, rdv.port, world, is_master=True, timeout=timeout,
            master_listen_fd=fd, use_libuv=True,
        )  # fmt: skip
    else:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            LOOPBACK, rdv.port, world, is_master=False, timeout=timeout
        )
    return {"store": store, "rank": rank, "world_size": world}


PIN_CORES_ENV = "DAPPLE_PIN_CORES"
"""``1``: each local rank runs on its own share of the machine's cores (:func:`pin_cores`)."""


def pin_cores(local_rank: int, local_world: int) -> list[int] | None:
    """With ``DAPPLE_PIN_CORES=1``, bind this process to cores ``[k * c, (k + 1) * c)`` of the
    cores it may use (``c`` = cores // local_world, ``k`` = local_rank), so local ranks do not
    time-slice each other's cores; the cores taken, or None (not asked, or unsupported)."""
    if os.environ.get(PIN_CORES_ENV) != "1" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // max(1, local_world))
    mine = cores[(local_rank * share) % len(cores) :][:share]
    os.sched_setaffinity(0, mine)
    return mine


def processes_text(world: int, article: str = "each of") -> str:
    """``the process`` / ``each of 4 processes`` (``article`` before a count above one)."""
    return "the process" if world == 1 else f"{article} {world} processes"
