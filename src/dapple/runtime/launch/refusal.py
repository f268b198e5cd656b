"""A worker's refusal ends a local launch in one line.

A rank may refuse the run on its own once the workers are up (a bad checkpoint, a model that
cannot be built or split there, an option only the rank can check): a
:class:`~dapple.errors.DappleError` of its own, not a lost peer
(:func:`~dapple.runtime.launch.failure.lost_peer`) nor a failed action
(:class:`~dapple.runtime.launch.failure.RankFailure`). Were it to exit, its peers waiting for it
in a collective would each fail with a lost peer, and gloo may print a C++ stack trace as the
sockets close. Instead the rank hands its error to the launcher - pickled into the launch's
refusal folder (:func:`refusal_folder`) - and waits (:func:`hand_over`). The launcher, which
polls the folder while it waits for its workers (:func:`refused`), kills every worker with
SIGKILL, so that no peer sees a socket close, and raises that error: the command line prints it
as its one ``dapple: error:`` line and exits 2.

Under ``torchrun`` there is no such folder and no launcher of dapple's; the agent's store
(which outlives every worker) counts the refusals of an attempt instead (:func:`end_refused`):
the first rank to refuse writes the one line and every rank ends with exit 2 - a refusal every
rank makes alike (a check before the rendezvous, of the same files and flags everywhere) as much
as one rank's own. The store also keeps that line and counts per node (``GROUP_RANK``), so that
each node of the job writes it once: on a node where no rank refused, the first rank that lost
its peer to the refusal (:func:`refused_elsewhere`) writes it, the others end without a line.

torchrun's agent reports a job whose worker exited non-zero itself, after dapple's line: its
``ChildFailedError`` summary (``torch.distributed.run.main`` is wrapped in torch's ``record``,
which re-raises it). No worker can prevent it short of exiting 0, which would report a refused
run as done. Each ending rank therefore writes dapple's line into torch's error file
(``TORCHELASTIC_ERROR_FILE``, set by the agent for each worker; :func:`error_file`), so that the
summary's "Root Cause" names the refusal instead of pointing to torch's errors page.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeGuard

from dapple.errors import DappleError, ValidationError
from dapple.runtime.launch.failure import RankFailure, lost_peer, rank_report

__all__ = [
    "end_if_refused",
    "end_rank",
    "end_refused",
    "error_file",
    "hand_over",
    "is_refusal",
    "refusal_folder",
    "refused",
    "refused_elsewhere",
    "set_refusal_folder",
]

_folder: str | None = None
"""This worker's launch's refusal folder (None: not a local launch's worker)."""


def refusal_folder() -> str:
    """A new private folder (mode 0700) for one launch's refusals; the launcher removes it."""
    return tempfile.mkdtemp(prefix="dapple-refusal-")


def set_refusal_folder(folder: str | None) -> None:
    """Where this worker hands a refusal over (:func:`hand_over`); set as the worker starts."""
    global _folder
    _folder = folder


def is_refusal(e: BaseException) -> TypeGuard[DappleError]:
    """Whether ``e`` is a rank's refusal of the run: a :class:`DappleError` of its own, not a
    failed action nor a lost peer."""
    return isinstance(e, DappleError) and not isinstance(e, RankFailure) and not lost_peer(e)


def hand_over(e: DappleError, rank: int) -> None:
    """Give ``e`` to the launcher and wait to be killed with every other worker; returns only
    outside a local launch (no refusal folder), where the caller reports ``e`` itself."""
    if _folder is None:
        return
    try:
        blob = pickle.dumps(e)
        pickle.loads(blob)  # an error whose class takes other arguments: sent as its text
    except Exception:
        blob = pickle.dumps(ValidationError(str(e)))
    part = Path(_folder, f"{rank}.part")
    part.write_bytes(blob)
    os.replace(part, Path(_folder, f"{rank}.pickle"))  # whole, or not there
    sys.stdout.flush()
    threading.Event().wait()  # the launcher kills this process (or its death ends it)


def refused(folder: str) -> DappleError | None:
    """The refusal of the lowest rank that handed one over into ``folder``, if any."""
    ranks = sorted(int(p.stem) for p in Path(folder).glob("*.pickle") if p.stem.isdigit())
    if not ranks:
        return None
    error = pickle.loads(Path(folder, f"{ranks[0]}.pickle").read_bytes())
    return error if isinstance(error, DappleError) else ValidationError(str(error))


def end_rank(e: BaseException, rank: int) -> NoReturn:
    """A spawned rank's end on ``e``: a refusal handed over (:func:`hand_over`), else its one
    line (:func:`~dapple.runtime.launch.failure.rank_report`, no traceback) and exit 1."""
    if is_refusal(e):
        hand_over(e, rank)
    _write_line(f"dapple: error: {rank_report(e, rank)}")
    os._exit(1)


def _write_line(line: str) -> None:
    """``line`` to stderr in one write (ranks share it), after this rank's stdout."""
    sys.stdout.flush()
    os.write(2, (line + "\n").encode())


# -- under torchrun ------------------------------------------------------------------------------
def _agent_store() -> Any | None:
    """A client of the ``torchrun`` agent's store (``TORCHELASTIC_USE_AGENT_STORE``), which
    lives as long as the agent; None elsewhere or when it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=30),
        )  # fmt: skip
    except (KeyError, ValueError, RuntimeError):  # DistStoreError is a RuntimeError
        return None


def _key() -> str:
    """The store key counting this attempt's refusals (a restart counts anew)."""
    return f"dapple/refused/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _first_on_node(store: Any) -> bool:
    """Whether this rank is the first of its node (``GROUP_RANK``) to end on this attempt's
    refusal (counted on the agent's store)."""
    return bool(store.add(f"{_key()}/node-{os.environ.get('GROUP_RANK', '0')}", 1) == 1)


def error_file(line: str) -> None:
    """``line`` as this ``torchrun`` worker's error in torch's error file
    (``TORCHELASTIC_ERROR_FILE``; nothing when unset), in the plain form torch's
    ``ProcessFailure`` reads (``{"message": str, "timestamp": int}``): the agent's failure
    summary shows it as the rank's error."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))


def end_refused(e: DappleError) -> NoReturn:
    """A ``torchrun`` rank's refusal of the run: the first rank of the attempt to refuse
    (counted on the agent's store) keeps ``dapple: error: e`` there as the job's line, and the
    first rank of each node to end writes it; exit 2. Without the agent's store every refusing
    rank writes its line."""
    line = f"dapple: error: {e}"
    store = _agent_store()
    try:
        if store is not None and store.add(_key(), 1) == 1:
            store.set(f"{_key()}/line", line)
        say = store is None or _first_on_node(store)
    except RuntimeError:
        say = True
    _end(line, say)


def _end(line: str, say: bool) -> NoReturn:
    """Exit 2 with ``line`` in torch's error file, and on stderr when ``say``."""
    error_file(line)
    if say:
        _write_line(line)
    else:
        sys.stdout.flush()
    os._exit(2)


def refused_elsewhere() -> bool:
    """Under ``torchrun``: whether a rank of this attempt refused the run
    (:func:`end_refused`), so that a rank which lost its peer to it need not say so."""
    store = _agent_store()
    if store is None:
        return False
    try:
        return bool(store.check([_key()]))
    except RuntimeError:
        return False


def _end_for_peer() -> NoReturn:
    """A ``torchrun`` rank's end on a peer's refusal: the job's line (kept on the agent's
    store) written by the first such rank of a node where no rank wrote it yet; exit 2."""
    line, say, store = "dapple: error: the run was refused on another rank", False, _agent_store()
    if store is not None:
        with contextlib.suppress(RuntimeError):  # the store gone: another node's line says it
            line = store.get(f"{_key()}/line").decode()
            say = _first_on_node(store)
    _end(line, say)


def end_if_refused(e: BaseException) -> None:
    """A ``torchrun`` rank's end on ``e`` when the run was refused: ``e`` itself a refusal
    (:func:`end_refused`: the job's one line), or a peer's (exit 2; the job's line once on
    each node). Returns when neither."""
    if is_refusal(e):
        end_refused(e)
    if refused_elsewhere():
        _end_for_peer()
