"""``dapple train``'s memory table says what its "estimate / added" ratio measures: no bare
ratio, and a stage whose ratio is far from 1 gets a line naming the side it is on."""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import make_cluster, make_profile
from dapple.api.predicting import planned_memory
from dapple.cli._memory_table import NOTE_RATIO, memory_notes, memory_table, ratio_text
from dapple.core.plan import straight_plan
from dapple.runtime.step_metrics import StepMetrics

MIB = 2**20


def test_ratio_text_never_prints_a_bare_zero() -> None:
    assert ratio_text(1.0 * MIB, 3.0 * MIB) == "0.33"
    assert ratio_text(0.1 * MIB, 41.0 * MIB) == "<0.01"
    assert ratio_text(5.0 * MIB, 0.0) == "-"
    assert ratio_text(30.0 * MIB, 10.0 * MIB) == "3.00"


def test_notes_say_what_added_measures_and_name_the_stages_far_from_one() -> None:
    estimates = [0.1 * MIB, 40.0 * MIB, 90.0 * MIB]
    added = [41.0 * MIB, 50.0 * MIB, 30.0 * MIB]
    lines = memory_notes(estimates, added, "VmHWM", held=[0.05 * MIB, 20.0 * MIB, 1.0 * MIB])
    assert lines[0].startswith("estimate / added: ")
    assert "VmHWM" in lines[0] and "tens of MiB" in lines[0]
    assert len(lines) == 3  # stage 1 (0.80) is within NOTE_RATIO: no line of its own
    small, big = lines[1], lines[2]
    assert small.startswith("stage 0: the estimate is 0.1 MiB of the 41.0 MiB added (<0.01)")
    assert "rank's own cost" in small and "51.2 KiB of held activations" in small
    assert big.startswith("stage 2: the estimate is 90.0 MiB against 30.0 MiB added (3.00)")
    assert "already held" in big


def test_notes_on_cuda_name_the_allocator() -> None:
    lines = memory_notes([1.0 * MIB], [64.0 * MIB], "cuda_max_reserved")
    assert "caching allocator" in lines[0] and "VmHWM" not in lines[0]
    assert lines[1].startswith("stage 0:") and "held activations" not in lines[1]


@pytest.mark.parametrize("ratio", [1 / NOTE_RATIO, 1.0, NOTE_RATIO])
def test_notes_within_the_ratio_add_no_stage_line(ratio: float) -> None:
    assert len(memory_notes([ratio * 10 * MIB], [10.0 * MIB], "VmHWM")) == 1


def test_no_notes_without_a_resident_measure() -> None:
    assert memory_notes([1.0 * MIB], [0.0], "") == []
    assert memory_notes([1.0 * MIB], [], "VmHWM") == []


def test_the_printed_table_carries_its_notes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, cluster = tmp_path / "p.json", tmp_path / "c.json"
    make_profile(4).save(prof)
    make_cluster().save(cluster)
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    last = StepMetrics(
        step=0, loss=1.0, step_ms=1.0, samples_per_s=1.0,
        peak_memory_bytes=(1 * MIB, 2 * MIB), memory_kind="held_activations",
        peak_resident_bytes=(300 * MIB, 300 * MIB),
        stage_resident_bytes=(10**6 * MIB, 10**6 * MIB), resident_kind="VmHWM",
    )  # fmt: skip
    memory_table(plan, last, planned_memory(plan, str(prof), str(cluster), "adamw"), "adamw")
    out = capsys.readouterr().out
    assert "estimate / added: the planner's estimate counts the stage's tensors" in out
    assert "stage 0: the estimate is" in out and "stage 1: the estimate is" in out
    assert "<0.01" in out and " 0.00 " not in out
