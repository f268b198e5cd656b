"""``--keep`` and ``--overwrite-checkpoints`` delete only what dapple wrote (issue 47, item 2):
a ``step-*`` directory holding a file no save writes is kept, with a warning, and starting over
in a directory holding one is refused up front."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dapple.datasets import prepare
from dapple.errors import ValidationError
from dapple.runtime.checkpoint.files import CheckpointError, step_dir
from dapple.runtime.checkpoint.ownership import (
    delete_checkpoints,
    foreign_entries,
    prune_checkpoints,
    refuse_foreign,
    refuse_occupied,
)


def _save(root: Path, step: int, *, manifest: bool = True, extra: str | None = None) -> Path:
    """A step directory with the files a save writes (and optionally a foreign one)."""
    d = step_dir(root, step)
    d.mkdir(parents=True)
    (d / "layer-00000.pt").write_bytes(b"w")
    (d / "rng-rank00000.pt").write_bytes(b"r")
    (d / "part-ab12-rank00000.json").write_text("{}")
    (d / ".layer-00001.pt.x7k_q.tmp").write_bytes(b"")  # an interrupted atomic write
    if manifest:
        (d / "manifest.json").write_text("{}")
    if extra is not None:
        (d / extra).write_text("mine")
    return d


def test_foreign_entries_names_what_no_save_writes(tmp_path: Path) -> None:
    d = _save(tmp_path, 1)
    assert foreign_entries(d) == []
    (d / "notes.txt").write_text("x")
    (d / "sub").mkdir()
    (d / "layer-00000.pt.bak").write_text("x")
    assert foreign_entries(d) == ["layer-00000.pt.bak", "notes.txt", "sub"]


def test_keep_prunes_only_directories_dapple_wrote(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    mine = _save(tmp_path, 1)
    theirs = _save(tmp_path, 2, extra="thesis.tex")
    crashed_theirs = _save(tmp_path, 3, manifest=False, extra="data.csv")
    crashed_mine = _save(tmp_path, 4, manifest=False)
    newest = _save(tmp_path, 5)
    with caplog.at_level(logging.WARNING, logger="dapple.runtime.checkpoint"):
        gone = prune_checkpoints(tmp_path, keep=1)
    assert gone == [mine, crashed_mine]
    assert not mine.exists() and not crashed_mine.exists()
    assert (theirs / "thesis.tex").read_text() == "mine"
    assert (crashed_theirs / "data.csv").read_text() == "mine"
    assert newest.exists()
    assert "thesis.tex" in caplog.text and "data.csv" in caplog.text
    caplog.clear()  # the next saves prune again: the kept directories are not said again
    with caplog.at_level(logging.WARNING, logger="dapple.runtime.checkpoint"):
        assert prune_checkpoints(tmp_path, keep=1) == []
    assert "thesis.tex" not in caplog.text


def test_overwrite_deletes_only_directories_dapple_wrote(tmp_path: Path) -> None:
    mine = _save(tmp_path, 1)
    theirs = _save(tmp_path, 2, manifest=False, extra="results.json")
    (tmp_path / "notes.txt").write_text("kept")
    assert delete_checkpoints(tmp_path) == [mine]
    assert (theirs / "results.json").read_text() == "mine"
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_starting_over_among_foreign_files_is_refused_up_front(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    refuse_foreign(tmp_path, "move them")  # only dapple's files: fine
    _save(tmp_path, 2, extra="thesis.tex")
    with pytest.raises(CheckpointError, match=r"step-00000002.*'thesis.tex'.*move them"):
        refuse_foreign(tmp_path, "move them")


def test_a_folder_of_foreign_files_is_not_called_a_checkpoint(tmp_path: Path) -> None:
    theirs = tmp_path / "step-00000001"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("mine")
    with pytest.raises(CheckpointError) as e:
        refuse_occupied(tmp_path, "pass --resume")
    msg = str(e.value)
    assert "already holds checkpoints" not in msg and "--resume" not in msg
    assert f"holds no checkpoint: {str(theirs)!r} holds files dapple did not write " in msg
    assert "('thesis.tex')" in msg and "move it away" in msg
    _save(tmp_path, 2, extra="notes.txt")  # a checkpoint with a user's note in it
    with pytest.raises(CheckpointError) as e:
        refuse_occupied(tmp_path, "pass --resume")
    msg = str(e.value)
    assert "already holds checkpoints (step 2) of another run (and " in msg
    assert (
        f"{str(theirs)!r} holds files dapple did not write ('thesis.tex'), which is never " in msg
    )
    assert msg.endswith("; pass --resume")


def keep_in_a_worker(rank: int, world: int, root: str) -> None:
    """A spawned worker's ``--keep`` pruning (run by :func:`test_a_workers_keep_warning_...`)."""
    prune_checkpoints(root, keep=1)


_LAUNCHER = """
import sys
sys.path.insert(0, {tests!r})
if __name__ == "__main__":  # (a spawned process imports this file too, as __mp_main__)
    import test_checkpoint_ownership as t
    from dapple.runtime.launch.launcher import spawn
    spawn(t.keep_in_a_worker, 1, {root!r}, timeout_s=120)
"""


def test_a_workers_keep_warning_is_a_dapple_warning_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "ck"
    theirs = _save(root, 1, extra="thesis.tex")
    _save(root, 2)
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER.format(tests=str(Path(__file__).parent), root=str(root)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    kept = [line for line in done.stderr.splitlines() if "thesis.tex" in line]
    assert kept == [
        f"dapple: warning: kept {theirs}: it holds files dapple did not write ('thesis.tex'); "
        "remove it yourself if unwanted"
    ]


def test_train_overwrite_checkpoints_refuses_foreign_files_before_compute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from builders import boom, one_error_line
    from dapple.cli import main
    from dapple.core.plan import straight_plan

    monkeypatch.setattr("dapple.runtime.train", boom)
    plan = tmp_path / "plan.json"
    straight_plan(5, [0], global_batch_size=2, num_micro_batches=1, model_name="mlp").save(plan)
    d = _save(tmp_path / "ck", 1, extra="thesis.tex")
    argv = ["train", "--plan", str(plan), "-m", "mlp", "--steps", "1", "--checkpoint-dir",
            str(tmp_path / "ck"), "--overwrite-checkpoints", "--save-every", "1"]  # fmt: skip
    assert main(argv) == 2
    one_error_line(capsys, "thesis.tex", "not deleted")
    assert (d / "thesis.tex").read_text() == "mine"


def test_train_in_a_folder_of_foreign_files_says_what_is_there_before_compute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from builders import boom, one_error_line
    from dapple.cli import main
    from dapple.core.plan import straight_plan

    monkeypatch.setattr("dapple.runtime.train", boom)
    plan = tmp_path / "plan.json"
    straight_plan(5, [0], global_batch_size=2, num_micro_batches=1, model_name="mlp").save(plan)
    theirs = tmp_path / "ck" / "step-00000001"
    theirs.mkdir(parents=True)
    (theirs / "thesis.tex").write_text("mine")
    argv = ["train", "--plan", str(plan), "-m", "mlp", "--steps", "1", "--checkpoint-dir",
            str(tmp_path / "ck")]  # fmt: skip
    assert main(argv) == 2
    one_error_line(capsys, "holds no checkpoint", "thesis.tex", "move it away")
    assert (theirs / "thesis.tex").read_text() == "mine"


# -- dapple data prepare never destroys its input or a file it did not write -----------------


def _prepare(*argv: str) -> int:
    from dapple.cli import main

    return main(["data", "prepare", *argv])


def test_prepare_refuses_to_overwrite_its_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from builders import one_error_line

    t = tmp_path / "t.txt"
    t.write_text("hello world\n")
    for out in (t, tmp_path / "sub" / ".." / "t.txt"):  # the check every command shares
        assert _prepare(str(t), "-o", str(out)) == 2
        line = one_error_line(capsys, f"-o/--output {str(out)!r} is the TEXT_FILE file")
        assert line.rstrip().endswith("this command reads: writing it would replace that input; write "
                             "elsewhere")  # fmt: skip
    assert not (tmp_path / "sub").exists()
    val = tmp_path / "x.val.bin"  # the validation file written beside x.bin
    val.write_text("precious")
    assert _prepare(str(val), "-o", str(tmp_path / "x.bin")) == 2
    one_error_line(capsys, f"validation file {str(val)!r} is the input text file this command")
    assert t.read_text() == "hello world\n" and val.read_text() == "precious"
    with pytest.raises(ValidationError, match="is the input text file"):  # the API refuses too
        prepare([t], tmp_path / "sub" / ".." / "t.txt")


def test_prepare_replaces_only_its_own_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from builders import one_error_line

    t = tmp_path / "t.txt"
    t.write_text("hello world\n" * 20)
    meta = tmp_path / "out" / "meta.json"
    meta.parent.mkdir()
    meta.write_text('{"mine": true}')
    out = tmp_path / "out" / "train.bin"
    assert _prepare(str(t), "-o", str(out)) == 2
    one_error_line(capsys, "meta.json", "not the meta file dapple data prepare wrote")
    assert meta.read_text() == '{"mine": true}' and not out.exists()
    meta.unlink()
    out.write_text("their tokens")
    assert _prepare(str(t), "-o", str(out)) == 2
    one_error_line(capsys, "train.bin", "exists and no meta.json beside it")
    assert out.read_text() == "their tokens"
    out.unlink()
    assert _prepare(str(t), "-o", str(out)) == 0  # fresh
    assert _prepare(str(t), "-o", str(out)) == 0  # a re-run replaces its own output
    assert _prepare(str(t), "-o", str(tmp_path / "out" / "other.bin")) == 2  # another's meta
    one_error_line(capsys, "not the meta file dapple data prepare wrote for 'other.bin'")


# -- a resume that would train nothing is refused (issue 47, item 6) -----------------------------


def test_resume_with_steps_already_done_is_refused(tmp_path: Path) -> None:

    import runtime_workloads as rw
    from dapple.api._checks import check_long_run
    from dapple.runtime.checkpoint import CheckpointMeta, save_checkpoint, stage_layer_states

    m = rw.mlp().build_model(0)
    meta = CheckpointMeta(model_name="test-mlp", num_layers=4, step=5)
    save_checkpoint(tmp_path, meta, stage_layer_states(m, 0))
    for steps in (3, 5):
        with pytest.raises(
            CheckpointError, match=rf"at step 5, which already covers --steps {steps}"
        ):
            check_long_run(str(tmp_path), rw.mlp(), 4, resume=True, steps=steps, flags=True)
    with pytest.raises(CheckpointError, match=r"^resume: .* already covers steps 5: .*steps above"):
        check_long_run(str(tmp_path), rw.mlp(), 4, resume=True, steps=5)  # the API's names
    check_long_run(str(tmp_path), rw.mlp(), 4, resume=True, steps=6)  # one step to go: fine


def test_resume_on_synthetic_batches_with_another_seed_is_refused(tmp_path: Path) -> None:

    import runtime_workloads as rw
    from dapple.api._checks import check_long_run
    from dapple.runtime.checkpoint import CheckpointMeta, save_checkpoint, stage_layer_states

    m = rw.mlp().build_model(0)
    meta = CheckpointMeta(model_name="test-mlp", num_layers=4, step=1, extra={"seed": 3})
    save_checkpoint(tmp_path, meta, stage_layer_states(m, 0))
    with pytest.raises(CheckpointError, match=r"synthetic batches of --seed 3, not 4.*--seed 3"):
        check_long_run(str(tmp_path), rw.mlp(), 4, resume=True, synthetic_seed=4, flags=True)
    check_long_run(str(tmp_path), rw.mlp(), 4, resume=True, synthetic_seed=3)
    check_long_run(str(tmp_path), rw.mlp(), 4, resume=True)  # a --data run: checked with the data


def test_resume_from_another_models_sizes_is_refused_before_launch(tmp_path: Path) -> None:
    """Same name, same layer count, other widths: refused from the manifest's shapes."""
    from torch import nn

    import runtime_workloads as rw
    from dapple.api._checks import check_long_run
    from dapple.runtime.checkpoint import CheckpointMeta, save_checkpoint, stage_layer_states

    wide = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    meta = CheckpointMeta(model_name="test-mlp", num_layers=4, step=1)
    save_checkpoint(tmp_path / "wide", meta, stage_layer_states(wide, 0))
    with pytest.raises(CheckpointError, match=r"is of another model: layer 0 tensor"):
        check_long_run(str(tmp_path / "wide"), rw.mlp(), 4, resume=True)
    same = rw.mlp().build_model(0)
    save_checkpoint(tmp_path / "same", meta, stage_layer_states(same, 0))
    check_long_run(str(tmp_path / "same"), rw.mlp(), 4, resume=True)
