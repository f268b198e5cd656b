"""Text files read whole as UTF-8, or refused in one line that names the file and the first bad
byte."""

from __future__ import annotations

from pathlib import Path

from dapple.errors import ValidationError

__all__ = ["read_text_file"]


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of file ``path``; ``what`` names the file in errors (``"cluster file"``).

    Raises:
        ValidationError: the file is missing, a directory, unreadable, or not UTF-8 text (the
            message names the first bad byte and its offset).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValidationError(f"cannot read {what} {str(p)!r}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValidationError(
            f"{what} {str(p)!r} is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} "
            "(a binary file?)"
        ) from None
