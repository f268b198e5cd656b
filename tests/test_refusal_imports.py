"""A train refusal of a bad option value comes before torch is imported (about 4 s of a 2-core
machine): the typed configuration's checks load no runtime module that needs torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dapple.core.plan import Plan
from dapple.core.stage_plan import StagePlan

_PROBE = """
import sys
from dapple.cli import main
for bad in sys.argv[2:]:
    rc = main(["train", "--plan", sys.argv[1], "-m", "mlp", *bad.split()])
    print(bad, rc, "torch" in sys.modules)
"""


def test_bad_train_options_are_refused_before_torch_is_imported(tmp_path: Path) -> None:
    plan = Plan(planner="test", global_batch_size=8, micro_batch_size=4, num_micro_batches=2,
                stages=(StagePlan(layers=(0, 2), devices=(0,)),))  # fmt: skip
    plan.save(tmp_path / "plan.json")
    bad = ["--steps 0", "--lr -1", "--precision fp8", "--warmup-steps -1", "--keep 2"]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "plan.json"), *bad],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.splitlines() == [f"{b} 2 False" for b in bad], out.stderr
    assert out.stderr.count("dapple: error:") == len(bad)
