"""dapple's ZB-V and DualPipeV compute orders against ``torch.distributed.pipelining``'s own:
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` build each rank's order in
``_calculate_single_rank_operations`` (private; skipped where this torch has none), which reads
only the rank count, stage count and M. The same orders are what ``schedules_measured_v.py``
compares the runtimes on; DualPipeV's overlapped pairs are taken in their sub-actions' order,
as dapple runs them."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from dapple.schedule.dualpipev import dualpipev
from dapple.schedule.ir import ComputeOrder
from dapple.schedule.zbv import zbv

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def _torch_order(cls: Any, P: int, M: int, g: int) -> list[str]:
    """Rank g's actions of ``cls`` as dapple's action strings (``3I0``), pairs flattened."""
    build = getattr(cls, "_calculate_single_rank_operations", None)
    if build is None:
        pytest.skip(f"this torch's {cls.__name__} has no _calculate_single_rank_operations")
    shape = SimpleNamespace(pp_group_size=P, num_stages=2 * P, _n_microbatches=M)

    def flat(a: Any) -> list[str]:
        if a.computation_type.name == "OVERLAP_F_B":
            return [x for sub in a.sub_actions for x in flat(sub)]
        return [f"{a.stage_index}{KIND[a.computation_type.name]}{a.microbatch_index}"]

    return [x for a in build(shape, g) if a is not None for x in flat(a)]


@pytest.mark.parametrize(
    ("cls_name", "order", "min_m"),
    [
        ("ScheduleZBVZeroBubble", zbv, lambda P: 1),
        ("ScheduleDualPipeV", dualpipev, lambda P: 2 * P),
    ],
)
def test_each_rank_runs_torchs_order_action_for_action(
    cls_name: str, order: Callable[[int, int], ComputeOrder], min_m: Callable[[int], int]
) -> None:
    cls = getattr(pipelining, cls_name)
    checked = 0
    for P in (2, 3, 4):
        for M in range(min_m(P), 2 * P + 6):
            ours = order(P, M)
            for g in range(P):
                assert [str(a) for a in ours[g]] == _torch_order(cls, P, M, g), (P, M, g)
                checked += 1
    assert checked >= 3 * 2 * 4
