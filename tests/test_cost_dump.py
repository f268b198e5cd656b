"""tests/cost_dump.py's one-pair-at-a-time mode: the folder it writes and the folder compare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import cost_dump


def _write(folder: Path, name: str, data: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_folders_compare_the_files_both_hold_and_count_differences_by_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = {"dapple": {"simulate": {"step_ms": 1.5, "devices": [{"busy_ms": 2.0}]}}}
    _write(tmp_path / "a", "bert48@paper-a", row)
    _write(tmp_path / "b", "bert48@paper-a", row)
    _write(tmp_path / "a", "vgg19@paper-b", row)  # only before: named, not compared
    assert cost_dump.compare(tmp_path / "a", tmp_path / "b") == 0
    out = capsys.readouterr().out
    assert "vgg19@paper-b: only in before (not compared)" in out
    assert "2 numbers compared, 2 equal" in out

    changed = {"dapple": {"simulate": {"step_ms": 1.75, "devices": [{"busy_ms": 2.5}]}}}
    _write(tmp_path / "b", "bert48@paper-a", changed)
    assert cost_dump.compare(tmp_path / "a", tmp_path / "b") == 1
    out = capsys.readouterr().out
    assert "2 differences" in out
    assert "1  /bert48@paper-a/dapple/simulate/devices[]/busy_ms" in out
    assert "/bert48@paper-a/dapple/simulate/step_ms: 1.5 != 1.75" in out


def test_pairs_are_model_slash_cluster_and_unknown_ones_are_refused_by_name() -> None:
    args = cost_dump.argparse.Namespace(pairs=["bert48/paper-a", "vgg19/h100-8x"])
    assert cost_dump._pairs(args) == [("bert48", "paper-a"), ("vgg19", "h100-8x")]
    grid = cost_dump.argparse.Namespace(
        pairs=None, models=["gnmt16"], clusters=["paper-b", "paper-c"]
    )
    assert cost_dump._pairs(grid) == [("gnmt16", "paper-b"), ("gnmt16", "paper-c")]
    with pytest.raises(SystemExit, match="'bert48/paper-z'"):
        cost_dump._pairs(cost_dump.argparse.Namespace(pairs=["bert48/paper-z"]))


def test_out_dir_writes_each_pair_as_it_ends_and_skips_files_already_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str, bool]] = []

    def fake_pair(model: str, cname: str, best: bool) -> dict[str, Any]:
        calls.append((model, cname, best))
        return {"dapple": {"L": float(len(calls))}}

    monkeypatch.setattr(cost_dump, "dump_pair", fake_pair)
    monkeypatch.setattr(cost_dump, "dump_extra", lambda: {"zero1/bert48": {"L": 9.0}})
    monkeypatch.setattr(cost_dump, "dump_profiles", lambda: {"bert48": {"F": 1.0}})
    _write(tmp_path, "vgg19@paper-b", {"kept": 1})
    cost_dump.main(
        ["--out-dir", str(tmp_path), "--pairs", "bert48/paper-a", "vgg19/paper-b", "--no-best"]
    )
    assert calls == [("bert48", "paper-a", False)]
    assert json.loads((tmp_path / "bert48@paper-a.json").read_text()) == {"dapple": {"L": 1.0}}
    assert json.loads((tmp_path / "vgg19@paper-b.json").read_text()) == {"kept": 1}
    assert json.loads((tmp_path / "extra.json").read_text()) == {"zero1/bert48": {"L": 9.0}}
    assert json.loads((tmp_path / "profiles.json").read_text()) == {"bert48": {"F": 1.0}}
    assert not list(tmp_path.glob("*.part"))
