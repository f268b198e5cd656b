"""Files written whole or not at all (:func:`dapple.files.atomic_file.write_atomically`), the one
writer of checkpoint files and token files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dapple.files import atomic_file
from dapple.files.atomic_file import write_atomically


def test_writes_the_bytes_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "train.bin"
    target.write_bytes(b"old")
    write_atomically(target, b"new bytes")
    assert target.read_bytes() == b"new bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin"]


def test_a_failed_rename_keeps_the_old_file_and_removes_the_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "layer-00000.pt"
    target.write_bytes(b"old")
    seen: list[str] = []

    def fail(src: str, dst: Path) -> None:
        seen.append(os.path.basename(src))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_file.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer-00000.pt"]
    # the temporary file was beside the target, named as the checkpoint listing recognises it
    assert len(seen) == 1 and seen[0].startswith(".layer-00000.pt.") and seen[0].endswith(".tmp")
