"""A config's own check names the flag the command line typed (``--save-every must be >= 0``),
the field in the Python API (``save_every must be >= 0``) and the file's key in a ``--config``
file's error (:func:`dapple.cli._config_args.flags_named`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple.cli import main
from dapple.cli._config_args import _renamed
from dapple.errors import ValidationError
from dapple.planner.plan_config import PlanConfig
from dapple.runtime.train_config import TrainConfig

PLAN = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a"]
TRAIN = ["train", "-m", "transformer", "--plan", "absent-plan.json"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            [*TRAIN, "--save-every", "-1", "--checkpoint-dir", "ck"],
            "--save-every must be >= 0, got -1",
        ),
        ([*TRAIN, "--steps", "0"], "--steps must be >= 1, got 0"),
        ([*TRAIN, "--lr", "inf"], "--lr must be finite, got inf"),
        ([*TRAIN, "--warmup-steps", "-2"], "--warmup-steps must be >= 0, got -2"),
        ([*TRAIN, "--eval-batch-size", "0"], "--eval-batch-size must be >= 1, got 0"),
        (
            [*TRAIN, "--resume", "--overwrite-checkpoints", "--checkpoint-dir", "ck"],
            "--resume keeps the checkpoints, --overwrite-checkpoints deletes them: give one",
        ),
        ([*PLAN, "--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
        ([*PLAN, "--servers", "0"], "--servers must be >= 1, got 0"),
        (
            ["verify", "-m", "transformer", "--plan", "absent-plan.json", "--steps", "0"],
            "--steps must be >= 1, got 0",
        ),
        (
            ["data", "prepare", "absent.txt", "-o", "out.bin", "--val-fraction", "1.5"],
            "--val-fraction must be in [0, 1), got 1.5",
        ),
        (
            ["profile", "-m", "transformer", "--co-workers", "0", "-o", "p.json"],
            "--co-workers must be >= 1, got 0",
        ),
        (
            [*PLAN, "--schedule", "interleaved", "--virtual-stages", "0"],
            "--virtual-stages must be >= 1, got 0",
        ),
    ],
)
def test_a_checks_error_names_the_flag_as_typed(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"dapple: error: {line}\n"
    assert list(tmp_path.iterdir()) == []


def test_the_api_names_the_field() -> None:
    with pytest.raises(ValidationError, match=r"^save_every must be >= 0, got -1$"):
        TrainConfig(save_every=-1, checkpoint_dir="ck")
    with pytest.raises(ValidationError, match=r"^global_batch_size must be >= 1, got 0$"):
        PlanConfig(profile="p", cluster="c", global_batch_size=0)


def test_a_config_files_bad_value_names_the_file_and_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[checkpoint]\ncheckpoint_dir = 'ck'\nsave_every = -1\n")
    assert main([*TRAIN, "--config", str(f)]) == 2
    assert capsys.readouterr().err == f"dapple: error: {f}: save_every must be >= 0, got -1\n"


def test_a_flag_beside_the_file_is_named_as_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[checkpoint]\ncheckpoint_dir = 'ck'\nsave_every = 2\n")
    assert main([*TRAIN, "--config", str(f), "--save-every", "-3"]) == 2
    assert capsys.readouterr().err == "dapple: error: --save-every must be >= 0, got -3\n"


def test_the_short_spelling_is_kept() -> None:
    names = {("model", "spec"): "-m", ("train", "save_every"): "--save-every"}
    assert _renamed("spec 'x' is bad", "model", names) == "-m 'x' is bad"


@pytest.mark.parametrize(
    ("message", "part", "out"),
    [
        # a field of another part keeps its name
        ("save_every must be >= 0", "data", "save_every must be >= 0"),
        # the root's check (part None) finds the field in any part
        ("save_every needs a dir", None, "--save-every needs a dir"),
        # a path or a longer name holding the field's name is left alone
        ("dir /tmp/save_every/x is bad", "train", "dir /tmp/save_every/x is bad"),
        ("my_save_every is bad", "train", "my_save_every is bad"),
        # a plain word inside the message is prose, not a field
        ("steps must be >= lr", "train", "--steps must be >= lr"),
        # a field no flag gave keeps its name
        ("lr must be > 0", "train", "lr must be > 0"),
    ],
)
def test_renaming_rules(message: str, part: str | None, out: str) -> None:
    names = {
        ("train", "save_every"): "--save-every",
        ("train", "steps"): "--steps",
        ("data", "path"): "--data",
    }
    assert _renamed(message, part, names) == out
