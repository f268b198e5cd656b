"""The README's Python API block runs as written (as a script: its workers import it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python_api_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python API", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's Python API section has no python block"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_python_api_block_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = tmp_path / "readme_api.py"
    script.write_text(_python_api_block())
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=850,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "step 9" in run.stdout  # echo=True printed every step


@pytest.mark.slow
def test_a_script_without_the_main_guard_is_told_what_to_add(tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import dapple.api as dp\n"
        "from dapple.core.plan import straight_plan\n"
        'wl = dp.load("mlp")\n'
        "plan = straight_plan(wl.num_layers, [0], global_batch_size=4, num_micro_batches=1,\n"
        "                     replicas=[2])\n"
        "dp.train(plan, wl, steps=1)\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=280,
        check=False,
    )  # fmt: skip
    assert run.returncode != 0
    assert 'put the calls under `if __name__ == "__main__":`' in run.stderr
