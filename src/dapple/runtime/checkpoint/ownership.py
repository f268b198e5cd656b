"""What a checkpoint directory holds and whose it is: ``--keep`` and ``--overwrite-checkpoints``
delete only ``step-*`` directories holding nothing but a save's files, and a run from step 0
refuses a directory holding another run's checkpoints, or folders of files dapple did not write.

Private to :mod:`dapple.runtime.checkpoint`, which re-exports the public names.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from dapple.runtime.checkpoint.files import (
    _STEP_DIR,
    MANIFEST_NAME,
    CheckpointError,
    list_checkpoints,
    logger,
    step_dir,
)

__all__ = [
    "delete_checkpoints",
    "describe_steps",
    "foreign_entries",
    "prune_checkpoints",
    "refuse_foreign",
    "refuse_occupied",
]

_OWN_FILE = re.compile(
    r"^\.?(manifest\.json|layer-\d{5,}\.pt|rng-rank\d{5,}\.pt|part-[\w-]+-rank\d{5,}\.json)"
    r"(\.\w+\.tmp)?$|^\.dapple-write-probe-\w+$"
)
"""The names of the files a save writes in a ``step-*`` directory (and its temporary files)."""


def foreign_entries(d: Path) -> list[str]:
    """The names in checkpoint directory ``d`` that no dapple save writes (a user's files,
    sub-directories): such a directory is never deleted."""
    try:
        return sorted(e.name for e in d.iterdir() if e.is_dir() or not _OWN_FILE.match(e.name))
    except OSError:  # gone meanwhile, or unreadable: nothing of it is deleted either
        return []


def _shown(names: list[str]) -> str:
    """The first three ``names``, quoted (``'a', 'b', 'c', ...``)."""
    return ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")


_KEPT_SAID: set[str] = set()
"""Checkpoint directories this process has warned it keeps (:func:`_remove_own`)."""


def _remove_own(d: Path) -> bool:
    """Delete checkpoint directory ``d`` when it holds only files a dapple save writes; else
    leave it whole with a warning. True if deleted."""
    foreign = foreign_entries(d)
    if foreign:
        if str(d) not in _KEPT_SAID:  # said once: every later save's pruning meets it again
            _KEPT_SAID.add(str(d))
            logger.warning(
                "kept %s: it holds files dapple did not write (%s); remove it yourself if unwanted",
                d,
                _shown(foreign),
            )
        return False
    shutil.rmtree(d, ignore_errors=True)
    return True


def prune_checkpoints(root: str | Path, keep: int, *, newest_step: int | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints, and incomplete ones older than
    the newest complete one - only directories holding nothing but the files a save writes
    (see :func:`foreign_entries`). Returns the deleted directories.

    Args:
        newest_step: the step just saved: checkpoints of later steps (left by a run this one
            resumed before, past a damaged one) neither count among the ``keep`` nor are
            deleted.
    """
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep}")
    dirs = list_checkpoints(root)
    if newest_step is not None:
        dirs = [d for d in dirs if d.name <= step_dir(root, newest_step).name]
    complete = [d for d in dirs if (d / MANIFEST_NAME).is_file()]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = complete[-1]
    doomed = [d for d in dirs if d not in kept and d.name < newest.name]
    return [d for d in doomed if _remove_own(d)]


def delete_checkpoints(root: str | Path) -> list[Path]:
    """Delete every checkpoint directory (``step-*``, complete or not) under ``root`` that
    holds only files a save writes; other files and directories stay. Returns the deleted
    directories."""
    return [d for d in list_checkpoints(root) if _remove_own(d)]


def _foreign_text(d: Path, foreign: list[str]) -> str:
    """``'DIR' holds files dapple did not write ('a', 'b', 'c', ...)``."""
    return f"{str(d)!r} holds files dapple did not write ({_shown(foreign)})"


def _holds_a_save(d: Path) -> bool:
    """``d`` holds a file a dapple save writes (it is a checkpoint, whatever else it holds)."""
    try:
        return any(_OWN_FILE.match(e.name) and not e.is_dir() for e in d.iterdir())
    except OSError:
        return False


def refuse_foreign(root: str | Path, how: str) -> None:
    """Refuse to start over in ``root`` when one of its ``step-*`` directories holds files
    dapple did not write: it could be neither deleted nor safely saved into.

    Args:
        how: the caller's ways out, appended to the message.

    Raises:
        CheckpointError: naming the directory and its first foreign entries.
    """
    for d in list_checkpoints(root):
        foreign = foreign_entries(d)
        if foreign:
            raise CheckpointError(
                f"checkpoint directory {_foreign_text(d, foreign)}: it is not deleted; {how}"
            )


def describe_steps(dirs: list[Path]) -> str:
    """``"steps 1, 2, 3"`` for checkpoint directories (``"step 4"`` for one; at most 5 shown)."""
    steps = [int(m.group(1)) for d in dirs if (m := _STEP_DIR.match(d.name))]
    shown = (
        ", ".join(map(str, steps))
        if len(steps) <= 5
        else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"
    )
    return f"step{'s' if len(steps) > 1 else ''} {shown}"


def refuse_occupied(root: str | Path, how: str) -> None:
    """Refuse to start a run from step 0 in a directory that holds checkpoints (complete or
    not) of another run: its saves would overwrite or, with pruning, delete them. A ``step-*``
    directory holding files dapple did not write is named as such, not as a checkpoint.

    Args:
        how: the ways out of another run's checkpoints, appended to the message.

    Raises:
        CheckpointError: ``root`` holds a ``step-*`` directory.
    """
    dirs = list_checkpoints(root)
    if not dirs:
        return
    foreign = {d: foreign_entries(d) for d in dirs}
    own = [d for d in dirs if not foreign[d] or _holds_a_save(d)]
    theirs = [_foreign_text(d, foreign[d]) for d in dirs if d not in own]
    if own:
        also = f" (and {theirs[0]}, which is never deleted)" if theirs else ""
        raise CheckpointError(
            f"checkpoint directory {str(root)!r} already holds checkpoints ({describe_steps(own)})"
            f" of another run{also}; {how}"
        )
    more = f" (and {len(theirs) - 1} more such folders)" if len(theirs) > 1 else ""
    raise CheckpointError(
        f"checkpoint directory {str(root)!r} holds no checkpoint: {theirs[0]}{more}, and a save "
        "of this run could land there, while dapple never deletes it; move it away or choose "
        "another directory"
    )
