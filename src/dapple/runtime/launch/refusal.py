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

Under ``torchrun`` there is no such folder and a rank exits with its line as before.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import threading
from pathlib import Path
from typing import TypeGuard

from dapple.errors import DappleError, ValidationError
from dapple.runtime.launch.failure import RankFailure, lost_peer

__all__ = ["hand_over", "is_refusal", "refusal_folder", "refused", "set_refusal_folder"]

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
