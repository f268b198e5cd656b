"""``dapple demo`` end to end on a short run: corpus, plan, train, validate, generate, 3:1 verify."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dapple.cli import main
from dapple.cli._demo_corpus import stdlib_sources, unigram_entropy


def test_unigram_entropy_of_known_distributions() -> None:
    assert unigram_entropy(np.array([7, 7, 7]), 256) == 0.0
    assert unigram_entropy(np.array([0, 1, 2, 3]), 256) == pytest.approx(np.log(4))


def test_stdlib_sources_stop_at_the_limit() -> None:
    files = stdlib_sources(200_000)
    assert files and all(p.suffix == ".py" for p in files)
    assert sum(p.stat().st_size for p in files[:-1]) <= 200_000


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    args = ["demo", "--steps", "12", "--corpus-mib", "0.3", "--out-dir", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 12 and summary["eval_losses"]
    assert (out / "loss.png").is_file() and (out / "gantt.png").is_file()
    assert "OK: largest gradient difference" in text  # verify of the 3:1 plan passed
    assert "demo: every check passed" in text
    assert "def __init__(self" in text  # the generated continuation


@pytest.mark.slow
def test_demo_exits_nonzero_when_a_check_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify that fails (rank 1's gradients perturbed) makes the demo fail, not just say so."""
    from dapple.runtime.verify import PERTURB_GRAD_RANK_ENV

    monkeypatch.setenv(PERTURB_GRAD_RANK_ENV, "1")
    out = tmp_path / "demo"
    args = ["demo", "--steps", "4", "--corpus-mib", "0.1", "--out-dir", str(out)]
    assert main(args) == 1
    text = capsys.readouterr().out
    assert "check failed: verify of 3:1: stage 0: step 0 gradient of" in text
    assert "check(s) failed" in text
