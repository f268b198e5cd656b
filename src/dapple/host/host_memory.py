"""The C allocator of CPU ranks: keep freed memory for the next step instead of returning it.

A training step allocates and frees the same activations every step. glibc's ``malloc`` serves
large blocks with ``mmap`` and gives the top of its heap back to the kernel once more than
``M_TRIM_THRESHOLD`` of it is free; both thresholds adapt to the program's history. When a step
frees everything it allocated (as the runtime does: a finished micro-batch keeps nothing), the
next step's forward gets fresh pages from the kernel and pays a page fault for each. Measured on
the demo's model (one process, bf16, AdamW): ~3,600-4,400 minor faults and 7.5-9.6 ms of kernel
time per 35-40 ms step, vs 0.3 faults and 0.4 ms with the thresholds below - a plain PyTorch loop
that happens to keep its last logits alive between steps avoids most of them by accident.

:func:`keep_freed_memory` fixes both thresholds (``mallopt``): blocks up to ``MMAP_THRESHOLD``
come from the heap, and the heap is trimmed only when more than ``TRIM_THRESHOLD`` is free. The
process's resident peak is unchanged (freed memory is reused, not added); its resident size
no longer shrinks between steps. Nothing happens off glibc (musl, macOS) or when
``DAPPLE_KEEP_FREED_MEMORY=0``. CUDA ranks do not need it: the caching allocator keeps device
memory, and their host allocations are small.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

__all__ = ["ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

logger = logging.getLogger(__name__)

ENV = "DAPPLE_KEEP_FREED_MEMORY"
"""Set to ``0`` to leave the C allocator's defaults alone."""
MMAP_THRESHOLD = 32 << 20
"""Bytes: blocks below this come from the heap (glibc refuses more than 32 MiB on 64-bit)."""
TRIM_THRESHOLD = 1 << 30
"""Bytes of free heap top kept before trimming."""
_M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc malloc.h)
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module docstring).

    Returns:
        True when both were set; False off Linux/glibc, when disabled by :data:`ENV`, or when
        ``mallopt`` refused (logged once).
    """
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok: bool = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.info("mallopt refused the thresholds; the C allocator keeps its defaults")
    return ok
