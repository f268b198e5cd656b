"""The GPU check v2's runner (benchmarks/gpu_check.py) without running its steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)


def test_each_part_fits_a_device_command_of_10_minutes() -> None:
    # the part's budget bounds its steps, with time left for the install and the packing
    assert gpu_check.PART_BUDGET_S <= 600 - 30
    steps = gpu_check._steps()
    assert set(steps) == set(gpu_check.STEP_NAMES)
    assert {s.part for s in steps.values()} == {"gpu", "cpu"}
    # the CPU steps' limits are above what they were measured at on 12 dedicated cores
    assert gpu_check.LIMIT_CPU_FIDELITY_S > 108
    assert gpu_check.LIMIT_CPU_PIPELINING_S > 200
    cpu = sum(s.limit_s for s in steps.values() if s.part == "cpu")
    assert cpu + gpu_check.LIMIT_VERSIONS_S <= gpu_check.PART_BUDGET_S


def test_steps_past_the_budget_are_recorded_as_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "PART_BUDGET_S", 0)
    results = gpu_check.run_part(tmp_path, tmp_path / "cpu", "cpu", dry=False)
    assert list(results) == ["versions", "cpu_fidelity", "cpu_pipelining"]
    report = (tmp_path / "cpu.md").read_text()
    assert report.count("| not run: the part's 0 s were spent | 0 | 0 |") == 3
    assert (tmp_path / "cpu.tar.gz").stat().st_size > 0
