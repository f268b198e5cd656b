"""What a new user meets (issue 47, item 9): ``dapple plan-local`` prints a ``dapple train``
command that carries every model option it was given and refuses an unwritable ``--out-dir``
before measuring; generated text cannot drive the terminal; ``--help`` is plain text; the
speed-up over an infeasible data parallelism and a cluster with other servers read well."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from builders import boom, one_error_line
from dapple.cli import build_parser, main
from dapple.cli.plan_local_cmd import plan_local_config_of, train_command


def test_train_command_keeps_the_model_options() -> None:
    argv = ["plan-local", "-m", "transformer", "--set", "layers=8", "--set", "seq_choices=[8, 16]",
            "--global-batch-size", "8", "--out-dir", "o", "--precision", "bf16"]  # fmt: skip
    args = build_parser().parse_args(argv)
    line = train_command(plan_local_config_of(args), Path("o") / "plan.json")
    words = shlex.split(line)
    assert words[:2] == ["dapple", "train"]
    train = build_parser().parse_args(words[1:])  # it parses as a train command
    assert train.set == ["layers=8", "seq_choices=[8, 16]"]
    assert train.model == "transformer" and train.precision == "bf16"
    assert train.plan == str(Path("o") / "plan.json")


def test_unwritable_out_dir_is_refused_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dapple.calibrate.local.plan_local", boom)
    (tmp_path / "f").write_text("x")
    argv = ["plan-local", "-m", "mlp", "--global-batch-size", "4", "--out-dir"]
    assert main([*argv, str(tmp_path / "f")]) == 2
    one_error_line(capsys, "is a file, not a directory")
    assert main([*argv, str(tmp_path / "f" / "sub")]) == 2
    one_error_line(capsys, "is a file, not a directory")


def test_generated_text_cannot_drive_the_terminal() -> None:
    from dapple.cli.generate_cmd import terminal_safe

    assert terminal_safe("a\x1b[31mb\nc\td\x00\u00e9") == "a\\x1b[31mb\nc\td\\x00\u00e9"


@pytest.mark.parametrize("argv", [["train"], ["verify"], ["data", "prepare"]])
def test_help_has_no_restructuredtext_markup(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:`" not in out and ":class:`" not in out


def test_speed_up_over_infeasible_dp_and_servers_name() -> None:
    from builders import make_cluster
    from dapple.cli._plan_show import speedup_text

    assert speedup_text(float("nan"), 2.0) == "n/a (data parallelism alone does not fit)"
    assert speedup_text(4.0, 2.0) == "2.00x"
    assert make_cluster().with_servers(2).name.endswith("(2 servers)")
