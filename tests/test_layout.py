"""The picture of a plan's stages on a cluster's servers (``dapple simulate --layout``)."""

from __future__ import annotations

from pathlib import Path

from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan, StagePlan
from dapple.simulate.layout import layout_cells, plot_layout, stage_label


def _plan_3d() -> Plan:
    """Stage 0: 2 replicas x t=2 with ZeRO-3; stage 1: 1 replica x t=4 (8 devices, 1 server)."""
    return Plan(
        planner="test",
        global_batch_size=8,
        micro_batch_size=2,
        num_micro_batches=4,
        stages=(
            StagePlan(layers=(0, 3), devices=(0, 1, 2, 3), tensor_width=2, zero_stage=3),
            StagePlan(layers=(3, 6), devices=(4, 5, 6, 7), tensor_width=4),
        ),
    )


def test_cells_are_replica_major_tensor_groups() -> None:
    cells = layout_cells(_plan_3d())
    assert cells == {
        0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1),
        4: (1, 0, 0), 5: (1, 0, 1), 6: (1, 0, 2), 7: (1, 0, 3),
    }  # fmt: skip


def test_stage_labels_name_layers_widths_and_zero() -> None:
    a, b = _plan_3d().stages
    assert stage_label(0, a) == "stage 0: layers 0-2, 2 x 2 devices, ZeRO-3"
    assert stage_label(1, b) == "stage 1: layers 3-5, 1 x 4 devices"


def test_picture_is_written(tmp_path: Path) -> None:
    out = tmp_path / "layout.png"
    plot_layout(_plan_3d(), load_cluster("h100-8x", 1), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_writes_the_layout(tmp_path: Path) -> None:
    from dapple.cli import main
    from dapple.profiler.analytic import analytic_profile

    prof = tmp_path / "p.json"
    analytic_profile("llama3-8b", "h100").save(prof)
    plan = tmp_path / "plan.json"
    n = 34  # embedding, 32 blocks, head
    Plan(
        planner="test", global_batch_size=8, micro_batch_size=2, num_micro_batches=4,
        stages=(StagePlan(layers=(0, 17), devices=(0, 1, 2, 3), tensor_width=2, zero_stage=3),
                StagePlan(layers=(17, n), devices=(4, 5, 6, 7), tensor_width=4)),
    ).save(plan)  # fmt: skip
    out = tmp_path / "layout.svg"
    args = ["--profile", str(prof), "--cluster", "h100-8x", "--servers", "1"]
    assert main(["simulate", "--plan", str(plan), *args, "--layout", str(out)]) == 0
    assert "stage 1: layers 17-33, 1 x 4 devices" in out.read_text()
