"""The prepared GPU check (benchmarks/gpu_check.sh) in its dry run: no GPU needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real check")
def test_the_gpu_check_dry_run_records_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("DAPPLE_GPU_CHECK_DEVICE", None)
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = (tmp_path / "gpu.md").read_text()
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in report.splitlines()
        if line.startswith("| ") and line.count("|") == 5
    }
    assert rows["versions"] == "ok"
    for step in ("verify", "profile", "vs_plain"):
        assert rows[step] == "skipped: no CUDA device (dry run)", rows
    for step in ("cpu_pipelining", "cpu_fidelity"):
        assert rows[step] == "ok", rows
    assert f"| torch | {torch.__version__} |" in report
