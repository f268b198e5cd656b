"""``dapple profile`` is flags -> :class:`~dapple.api.profiling.ProfileConfig` -> ``api.profile``:
the CLI, ``profile(cfg)`` and the keyword form go down one path (issue 42, item 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dapple import api
from dapple.api.profiling import MAX_RUNS, ProfileConfig
from dapple.api.run_config import ModelConfig
from dapple.cli import main
from dapple.errors import ValidationError

_ANALYTIC = ProfileConfig(model=ModelConfig(spec="llama3-8b"), analytic="h100",
                          batch_sizes=(1, 2), seq_lens=(1024, 2048))  # fmt: skip


def test_the_cli_writes_what_profile_cfg_returns(tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    argv = ["profile", "--analytic", "h100", "-m", "llama3-8b", "--batch-sizes", "1,2",
            "--seq-lens", "1024,2048", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    from_api = api.profile(_ANALYTIC)
    assert from_api.by_length and json.loads(out.read_text()) == from_api.to_dict()


def test_profile_cfg_saves_its_output_and_takes_no_keyword_option_beside_it(
    tmp_path: Path,
) -> None:
    import dataclasses

    out = tmp_path / "p.json"
    prof = api.profile(dataclasses.replace(_ANALYTIC, output=str(out)))
    assert json.loads(out.read_text()) == prof.to_dict()
    with pytest.raises(ValidationError, match="takes the profiling options from cfg, got also "
                       "repeats, precision"):  # fmt: skip
        api.profile(_ANALYTIC, repeats=3, precision="bf16")  # type: ignore[call-overload]


def test_the_keyword_form_is_checked_as_the_cli_is_before_any_measuring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def measured(*_: Any, **__: Any) -> None:
        raise AssertionError("measured")

    monkeypatch.setattr("dapple.profiler.measure.profile_workload", measured)
    with pytest.raises(ValidationError, match=f"--repeats must be from 1 to {MAX_RUNS}"):
        api.profile("mlp", repeats=MAX_RUNS + 1)
    with pytest.raises(ValidationError, match="--threads must be from 1 to the"):
        api.profile("mlp", num_threads=10**5, device="cpu")


def test_reading_a_profile_config_does_not_import_torch() -> None:
    code = (
        "import sys; from dapple.api.profiling import ProfileConfig; "
        "from dapple.api.run_config import ModelConfig; "
        "ProfileConfig(model=ModelConfig(spec='mlp')); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("repeats", 1.5, r"^repeats must be an integer, got 1\.5$"),
        ("warmup", 0.5, r"^warmup must be an integer, got 0\.5$"),
        ("repeats", True, "^repeats must be an integer, got True$"),
        ("repeats", 0, "--repeats must be from 1 to"),  # refused after the model was built
        ("num_threads", 1.5, r"^threads must be an integer, got 1\.5$"),
        ("co_workers", 2.0, r"^co_workers must be an integer, got 2\.0$"),
    ],
)
def test_the_keyword_form_refuses_counts_that_are_not_integers(
    monkeypatch: pytest.MonkeyPatch, option: str, value: object, message: str
) -> None:
    """Counts the CLI parses as integers reach the Python API as given: a float failed inside
    torch after the model was built (``TypeError``, ``set_num_threads expects an int``), and
    the keyword form built the model before checking any option."""
    from builders import boom

    monkeypatch.setattr("dapple.models.zoo.load_workload", boom)
    with pytest.raises(ValidationError, match=message):
        api.profile("mlp", (1,), "cpu", **{option: value})
