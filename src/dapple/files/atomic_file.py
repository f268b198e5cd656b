"""Files written whole or not at all: the data goes to a temporary file beside the target
(``.NAME.XXXXXXXX.tmp``), is flushed and fsync'ed, and the temporary file is renamed over the
target, so a reader - or a run that crashed mid-write - sees the old file or the new one, never
a part. Pure ``os``/``pathlib``, no torch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``;
    on any failure the temporary file is removed and ``path`` is left as it was.

    Raises:
        OSError: the temporary file cannot be created, written or renamed.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
