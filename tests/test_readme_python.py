"""A script that starts processes without the ``__main__`` guard is told what to add.

The README's Python API block itself runs in ``tests/test_readme_blocks.py`` (``Python API#0``),
with every other README block.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


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
