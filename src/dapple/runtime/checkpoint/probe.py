"""The checkpoint directory's write probe: proves, before training, that a save can write
there, leaving nothing behind (several ranks may probe one directory at once)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from dapple.runtime.checkpoint.files import CheckpointError

__all__ = ["check_writable"]


def check_writable(root: str | Path) -> Path:
    """Prove a file can be written in ``root`` (before training), leaving nothing behind: the
    directories it creates for the probe are removed again (the first save creates them).

    Safe when several ranks check the same directory at once: a directory another rank made
    is not removed, and one that another rank removed mid-check is made again.

    Raises:
        CheckpointError: the directory cannot be created or written.
    """
    r = Path(root)
    made: list[Path] = []
    try:
        for attempt in range(_PROBE_ATTEMPTS):
            try:
                made += _make_missing(r)
                fd, probe = tempfile.mkstemp(prefix=".dapple-write-probe-", dir=r)
            except FileNotFoundError:  # another rank removed a directory it had made
                if attempt == _PROBE_ATTEMPTS - 1:
                    raise
                continue
            os.close(fd)
            os.unlink(probe)
            break
    except OSError as e:
        raise CheckpointError(
            f"checkpoint directory {str(r)!r} is not writable: {e.strerror or e}"
        ) from e
    finally:
        for d in reversed(made):  # innermost first; one another rank still uses stays
            with contextlib.suppress(OSError):
                d.rmdir()
    return r


_PROBE_ATTEMPTS = 10


def _make_missing(r: Path) -> list[Path]:
    """Create ``r`` and its missing parents; returns those this call created, outermost first."""
    made = []
    for d in reversed([d for d in (r, *r.parents) if not d.exists()]):
        try:
            d.mkdir()
        except FileExistsError:  # made by another rank meanwhile (or a file: mkstemp says so)
            continue
        made.append(d)
    return made
