"""``benchmarks/schedules_measured_counts.py``: the report of its counts, and (slow) dapple's V
schedules dispatching no more aten ops over torch's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` than dapple's 1F1B does over torch's ``Schedule1F1B`` (counts, not
times: the machine's load does not move them)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import schedules_measured_counts as smc
from dapple.core.plan import Plan


def _case(label: str, ops: dict[str, dict[str, int]], cpu: float) -> dict[str, Any]:
    """A case as the workers report it: two ranks, each with one counted step of ``ops``."""
    rank = {"ops": [ops], "calls": [{"f": 10}], "cpu_ms": [cpu, cpu + 5]}
    return {"label": label, "ranks": [rank, rank]}


def test_the_pairs_run_the_same_chunks_in_the_same_placement() -> None:
    cases = smc.build_cases(blocks=2, G=8, M=4, ranks=2)
    assert [c["label"] for c in cases] == [
        "dapple 1f1b",
        "torch Schedule1F1B",
        "dapple zbv",
        "torch ScheduleZBVZeroBubble",
        "dapple dualpipev",
        "torch ScheduleDualPipeV",
    ]
    for d, t in zip(cases[0::2], cases[1::2], strict=True):
        plan = Plan.from_dict(d["plan"])
        assert [list(st.layers) for st in plan.stages] == t["chunks"]
        assert [plan.group_of_stage(k) for k in range(len(t["chunks"]))] == t["placement"]
    assert cases[3]["placement"] == [0, 1, 1, 0]


def test_the_report_sums_the_ranks_and_lists_the_ops_that_differ(tmp_path: Path) -> None:
    empty = {k: {} for k in smc.KINDS}
    mine = {**empty, "F": {"aten::mm": 3, "aten::clone": 1}, "other": {"aten::add": 1}}
    theirs = {**empty, "F": {"aten::mm": 3}}
    got = [
        _case("dapple zbv (before)", mine, 10.0),
        _case("dapple zbv", {**mine, "other": {}}, 8.0),
        _case("torch ScheduleZBVZeroBubble", theirs, 9.0),
    ]
    args = argparse.Namespace(
        blocks=2, global_batch=8, micro_batches=4, ranks=2, warmup=1, counted=1, timed=2, top=4
    )
    text = "\n".join(smc.report(got, args))
    assert "| dapple zbv (before) | 8 / 0 / 0 / 0 / 2 | 10 | 20 | 20 |" in text
    assert "| torch ScheduleZBVZeroBubble | 6 / 0 / 0 / 0 / 0 | 6 | 20 | 18 |" in text
    assert "- dapple zbv / torch ScheduleZBVZeroBubble:\n  - F: `clone` 2/0" in text
    assert "- dapple zbv (before) / dapple zbv:\n  - other: `add` 2/0" in text
    md = tmp_path / "report.md"
    md.write_text("# runs\n")
    smc.splice(md, ["## counts", "first"])
    smc.splice(md, ["## counts", "second"])
    out = md.read_text()
    assert out.startswith("# runs\n") and out.count(smc.BEGIN) == 1 and "first" not in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dapples_v_schedules_add_over_torchs_no_ops_that_its_1f1b_does_not() -> None:
    """Two ranks, a V of 4 one-block chunks, M = 4, one counted step each: dapple's F and its
    backward's ops (B, I and W together) exceed torch's by what dapple's 1F1B's exceed torch's
    1F1B's on the same model (the loss computed inside the last stage's F, the guard's
    float64 loss sum), no more: no copy of the stage outputs for the split backward, no second
    lookup of the weights' gradient nodes in a W. Outside the actions a V step's ops are a 1F1B
    step's but for the messages' own (a receive buffer, an activation's detach): nothing copies
    the tensors handed between rank 1's two chunks, nothing adds up the chunks' loss parts."""
    from _bench_common import run_worker_group

    opts = {"blocks": 2, "G": 8, "M": 4, "warmup": 2, "counted": 1, "timed": 0}
    cases = smc.build_cases(2, 8, 4, 2)
    got = run_worker_group(smc.worker, 2, cases, opts)["cases"]
    ops = {c["label"]: smc._summed(c)[0] for c in got}

    def total(label: str, kinds: str) -> int:
        return sum(sum(ops[label][k].values()) for k in kinds)

    control = {kinds: total("dapple 1f1b", kinds) - total("torch Schedule1F1B", kinds)
               for kinds in ("F", "BIW")}  # fmt: skip
    for mine, theirs in (("zbv", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")):
        for kinds, excess in control.items():
            got_excess = total(f"dapple {mine}", kinds) - total(f"torch {theirs}", kinds)
            assert got_excess <= excess, (mine, kinds, got_excess, excess)
        v, one = ops[f"dapple {mine}"]["other"], ops["dapple 1f1b"]["other"]
        moved = Counter({k: v[k] - one[k] for k in set(v) | set(one) if v[k] != one[k]})
        assert set(moved) <= {"aten::empty", "aten::detach"}, (mine, moved)
