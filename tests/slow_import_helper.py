"""A module whose import takes ``DAPPLE_TEST_IMPORT_S`` seconds (default 0), as torch's can on
a loaded machine: a spawned worker unpickling :func:`idle` stays in its imports that long."""

from __future__ import annotations

import os
import time

time.sleep(float(os.environ.get("DAPPLE_TEST_IMPORT_S", "0")))


def idle(*_: object) -> None:
    """Wait long enough to be seen."""
    time.sleep(60)
