"""Output paths checked before any work: a command that writes a file only at its end (token
files, metrics, a plan) refuses at its start a path it could not write then.

One rule for every output file of every command: folders missing above it are created when it
is written (:func:`make_parent_dirs`, ``mkdir -p``). A path is refused when it is a
directory, when a component of its folder is a regular file, when the nearest existing folder
cannot be written (``os.access`` and a real attempt: a probe file created and removed at once,
since root passes every permission check and a read-only mount or a full disk shows only when
writing), or, for writers that open the file in place, when the file exists read-only. The
check creates nothing. Pure ``os``/``pathlib``, no torch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from dapple.errors import ValidationError

__all__ = [
    "PICTURE_SUFFIXES",
    "check_output_dir",
    "check_output_file",
    "check_picture_file",
    "make_parent_dirs",
    "refuse_overwrite",
    "same_file",
]

PICTURE_SUFFIXES = (".png", ".svg", ".svgz", ".pdf", ".eps", ".ps", ".jpg", ".jpeg", ".tif",
                    ".tiff", ".webp")  # fmt: skip
"""Picture formats dapple's plots write (matplotlib's, with Pillow)."""


def _nearest_existing(folder: Path, what: str) -> Path:
    """``folder`` or its nearest ancestor that exists."""
    anc = folder
    while True:
        try:
            if anc.exists():
                return anc
        except OSError as e:  # e.g. a folder on the way that cannot be searched
            raise ValidationError(f"{what}: cannot reach {str(anc)!r}: {e.strerror or e}") from e
        if anc == anc.parent:
            return anc
        anc = anc.parent


def _probe(folder: Path, what: str) -> None:
    """Create and remove a file in ``folder``."""
    try:
        fd, name = tempfile.mkstemp(prefix=".dapple-write-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ValidationError(
            f"{what}: cannot write in folder {str(folder)!r}: {e.strerror or e}"
        ) from e


def check_output_file(path: str | os.PathLike[str], what: str, *, in_place: bool = True) -> Path:
    """Check that a file can be written at ``path``, before the work that produces it: missing
    folders above it are fine (the writer makes them, :func:`make_parent_dirs`), the nearest
    existing one must be a writable directory.

    Args:
        path: the file to write.
        what: names the file in errors, e.g. ``"--metrics file"``.
        in_place: the writer opens an existing file for writing, so it must be writable;
            False: the writer renames a new file over it (only the folder matters).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValidationError: one line naming the path and why it cannot be written.
    """
    p = Path(path)
    if p.is_dir():
        raise ValidationError(f"{what} {str(p)!r} is a directory; give a file path")
    _check_writable_above(p.parent, f"{what} {str(p)!r}")
    if in_place and p.exists():
        try:
            with open(p, "ab"):
                pass
        except OSError as e:
            raise ValidationError(f"{what} {str(p)!r} is not writable: {e.strerror or e}") from e
    return p


def check_output_dir(path: str | os.PathLike[str], what: str) -> Path:
    """Check that files can be written in the directory ``path`` (made with its missing parents
    when written), before the work that fills it.

    Args:
        path: the directory to write in.
        what: names it in errors, e.g. ``"--checkpoint-dir"``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValidationError: one line naming the path and why nothing can be written in it.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValidationError(f"{what} {str(p)!r} is a file, not a directory")
    _check_writable_above(p, f"{what} {str(p)!r}")
    return p


def _check_writable_above(folder: Path, label: str) -> None:
    """The nearest existing folder at or above ``folder`` is a directory this process can
    create files in (the missing ones below it are made when the output is written).

    Raises:
        ValidationError: ``label``, then why nothing can be written there.
    """
    anc = _nearest_existing(folder, label)
    if not anc.is_dir():
        raise ValidationError(f"{label}: {str(anc)!r} is a file, not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ValidationError(f"{label}: directory {str(anc)!r} is not writable")
    _probe(anc, label)


def check_picture_file(path: str | os.PathLike[str], what: str) -> Path:
    """:func:`check_output_file` for a plot: its suffix also names a known picture format.

    Raises:
        ValidationError: naming ``what``, the path and the formats.
    """
    checked = check_output_file(path, what)
    suffix = checked.suffix.lower()
    if suffix not in PICTURE_SUFFIXES:
        raise ValidationError(
            f"{what} {str(path)!r}: unknown picture format {suffix or '(none)'!r}; use one of "
            f"{', '.join(PICTURE_SUFFIXES)}"
        )
    return checked


def make_parent_dirs(path: str | os.PathLike[str]) -> Path:
    """Create the folders missing above the file ``path`` (``mkdir -p`` of its parent), as
    every writer of an output file does before writing it; returns ``path`` as a
    :class:`~pathlib.Path`.

    Raises:
        OSError: a folder cannot be created (:func:`check_output_file` refuses such a path
            before any work).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


PathLike = str | os.PathLike[str]


def same_file(written: PathLike, read: PathLike) -> bool:
    """Writing ``written`` would replace the existing file ``read``: both name one file (links
    included) or, while ``written`` does not exist, its path resolves to ``read``'s (``..``
    and links resolved: ``sub/../t.txt`` is ``t.txt`` once the writer made ``sub``)."""
    try:
        if not os.path.isfile(read):
            return False
        if os.path.exists(written):
            return os.path.samefile(written, read)
        return os.path.realpath(written) == os.path.realpath(read)
    except OSError:  # a path that cannot be searched: the writer or reader reports it
        return False


def refuse_overwrite(
    outputs: Iterable[tuple[PathLike, str]], inputs: Iterable[tuple[PathLike, str]]
) -> None:
    """Refuse an output that would replace an input file (:func:`same_file`).

    Args:
        outputs: ``(path, what)`` of each file a command writes (``what`` names it in the
            error, e.g. ``"-o/--output"``).
        inputs: ``(path, what)`` of each file it reads.

    Raises:
        ValidationError: one line naming the output, its path and the input.
    """
    read = list(inputs)
    for target, out_what in outputs:
        for path, in_what in read:
            if same_file(target, path):
                raise ValidationError(
                    f"{out_what} {os.fspath(target)!r} is the {in_what} file this command "
                    "reads: writing it would replace that input; write elsewhere"
                )
