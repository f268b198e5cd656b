"""Benchmark scripts: their pure helpers (Spearman, cut search, paper tables) on tiny inputs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _bench_common import median_after_warmup, spearman
from builders import make_cluster, make_profile


def test_spearman_known_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swap among 4: 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties share the mean rank
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="equal-length"):
        spearman([1], [1])


def test_median_after_warmup():
    assert median_after_warmup([100, 1, 2, 3], 1) == 2
    assert median_after_warmup([5, 7], 5) == 6  # fewer values than the warm-up: all of them


def test_fidelity_best_cuts_balances_a_pipeline():
    from dapple.core.plan import straight_plan
    from dapple.cost.pipeline import pipeline_latency
    from fidelity import best_cuts, label

    prof = make_profile(6, fwd=1.0, bwd=2.0, act=1000.0, params=1000)
    cluster = make_cluster(1, 4, 100.0)
    plan = best_cuts(prof, cluster, (1, 1), 8, 4, "dapple")
    assert [s.layers for s in plan.stages] == [(0, 3), (3, 6)]
    assert label(plan).startswith("1:1 cut 3 M=4")
    # no other cut of this replication predicts less
    L = pipeline_latency(plan, prof, cluster).L_ms
    for c in range(1, 6):
        other = straight_plan(6, [0, c], global_batch_size=8, num_micro_batches=4)
        assert pipeline_latency(other, prof, cluster).L_ms + 1e-9 >= L


def test_paper_gpipe_and_policy_tables_render():
    import paper

    lines, cut = paper.dapple_vs_gpipe()
    text = "\n".join(lines)
    assert 1 < cut < 49
    assert "| GPipe | no | 16 | OOM" in text  # GPipe without RC cannot hold 16 micro-batches
    assert "| DAPPLE | no | 16 | " in text and "DAPPLE | no | 16 | OOM" not in text
    policy = "\n".join(paper.policy_a_vs_b())
    assert "bert48 (64)" in policy and "gnmt16 (1024)" in policy


def test_bert24_is_bert_large_shaped():
    import paper

    p = paper.bert24()
    assert p.num_layers == 26 and p.model_name == "bert24"
