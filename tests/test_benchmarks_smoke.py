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


def test_plan_space_compares_grid_and_dapple_on_a_tiny_llama():
    import dataclasses

    import plan_space
    from dapple.core.cluster_presets import load_cluster
    from dapple.profiler.analytic import analytic_profile
    from dapple.profiler.analytic_presets import PRESETS

    spec = dataclasses.replace(PRESETS["llama3-8b"], name="tiny", layers=4, seq=512)
    profiles = {"full": analytic_profile(spec, "h100", precision="bf16", recompute="full")}
    cluster = load_cluster("h100-8x", servers=1)
    case = plan_space.compare("tiny", profiles, cluster, 16, seq=512, top=3)
    assert case.grid.plan.planner == "grid" and case.dapple.plan.planner == "dapple"
    assert case.dapple.L_ms <= case.grid.L_ms * (1 + 1e-9)
    assert case.speedup == pytest.approx(case.grid.step_ms / case.dapple.step_ms)
    assert 0 < case.dapple.peak_gib <= 80 and 0 < case.grid.peak_gib <= 80
    text = "\n".join(plan_space.report([case], "python benchmarks/plan_space.py"))
    assert "| tiny | 8 | 16 | dp" in text and "in 0 of 1 cases." in text
    assert text.count("| group | layers | r x t |") == 2
    assert plan_space.samples_per_gpu("llama3-8b") == 2 == plan_space.samples_per_gpu("llama3-70b")


def test_live_bytes_counts_a_linear_layers_adamw_state():
    import torch

    from tp_memory import LiveBytes, steady_extremes

    with LiveBytes() as live:
        lin = torch.nn.Linear(64, 32)  # 2080 parameters: 8320 bytes
        opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, fused=True)
        for _ in range(3):
            for p in lin.parameters():
                p.grad = None
            lin(torch.randn(4, 64)).sum().backward()
            opt.step()
    ext = steady_extremes(live)
    assert len(live.windows) == 3 and ext is not None
    # weights, gradients, and per parameter tensor two moments and a 4-byte step count
    assert ext["parts"] == {"parameters": 8320, "FSDP parameter shards": 0, "gradients": 8320,
                            "FSDP gradient shards": 0, "optimizer": 2 * 8320 + 2 * 4}  # fmt: skip
    assert ext["state_peak"] == 33288
    assert ext["state_low"] == 33288 - 8320  # between steps the gradients are dropped
    assert ext["step_peak"] >= 33288 + 4 * 64 * 4  # and the input batch is alive
    assert ext["collected"] == 0


def test_live_bytes_follows_frees_and_storage_resizes():
    import torch

    from tp_memory import LiveBytes

    with LiveBytes() as live:
        a = torch.empty(256)  # 1024 bytes
        assert live.total == 1024
        a.untyped_storage().resize_(0)  # FSDP frees a gathered parameter this way
        assert live.total == 0
        a.untyped_storage().resize_(2048)
        assert live.total == 2048
        del a
        assert live.total == 0
    assert torch.UntypedStorage.resize_ is not None and live._undo == []


def test_tp_memory_estimates_a_hand_made_profile():
    import dataclasses

    import tp_memory

    prof = make_profile(4, act=1000.0, params=4000)
    prof = dataclasses.replace(prof, layers=tuple(
        dataclasses.replace(layer, tensor_parallel=0 < i < 3) for i, layer in enumerate(prof.layers)
    ))  # fmt: skip
    one = tp_memory.estimate(tp_memory.plan_of("unsharded (1 rank)", 4), prof)
    tp2 = tp_memory.estimate(tp_memory.plan_of("TP2", 4), prof)
    # 16 bytes per fp32 AdamW parameter (the gradient in flight left out); TP2: the two middle
    # layers halved
    assert one["state"] == 4 * 16000
    assert tp2["state"] == 4 * (4000 + 2000 + 2000 + 4000)
    # the step peak (dapple.cost.peak_memory), K = 1 micro-batch of 2 samples x 4 layers x 1000
    # kept bytes (a TP layer keeps min(kept, 5 x output) whole: all of it here). One rank: a
    # later backward of the last layer: parameters and moments 48000, every gradient 16000,
    # the kept 8000, the arriving gradient 2000 and the layer's weight gradient 4000 in flight.
    assert one["step"] == 48000 + 16000 + 8000 + 2000 + 4000
    # TP2: the state with its gradients (they stay on tensor ranks) and the largest gradient in
    # flight, then the loss's moment: kept 8000, log-softmax 2000, its two gradients 4000
    assert tp2["step"] == 48000 + 4000 + 8000 + 2000 + 4000
    # FSDP x2 gathered once per step: whole parameters and gradients (2 x 16000), the parameter
    # shard and the moments' shards (8000 + 16000); regathered: every shard, (1 + 3) / 2 x 16000
    fsdp = tp_memory.estimate(tp_memory.plan_of("FSDP x2", 4), prof)
    again = tp_memory.estimate(tp_memory.plan_of("FSDP x2, regather", 4), prof)
    assert fsdp["state"] == 2 * 16000 + 8000 + 16000
    assert again["state"] == 2 * 16000


def _rank_row(state: int, step: int, low: int) -> dict[str, object]:
    parts = {"parameters": state // 4, "FSDP parameter shards": 0, "gradients": state // 4,
             "FSDP gradient shards": 0, "optimizer": state // 2}  # fmt: skip
    return {"state_peak": state, "parts": parts, "step_peak": step,
            "other_at_step_peak": step - state, "state_low": low, "collected": 0}  # fmt: skip


def test_tp_memory_tables_compare_with_the_unsharded_stage():
    import tp_memory

    mib = tp_memory.MIB
    results = {
        "unsharded (1 rank)": [_rank_row(100 * mib, 110 * mib, 80 * mib)],
        "TP2": [_rank_row(55 * mib, 60 * mib, 44 * mib), _rank_row(54 * mib, 61 * mib, 40 * mib)],
        "FSDP x2": [_rank_row(88 * mib, 100 * mib, 40 * mib)] * 2,
        "FSDP x2, regather": [_rank_row(100 * mib, 110 * mib, 40 * mib)] * 2,
        "TP2 x FSDP2": [_rank_row(48 * mib, 50 * mib, 20 * mib)] * 4,
    }
    w = tp_memory.worst(results)
    assert w["TP2"]["state_peak"] == 55 * mib and w["TP2"]["step_peak"] == 61 * mib
    assert w["TP2"]["ranks"] == 2
    ests = {n: {"state": r["state_peak"], "step": r["step_peak"]} for n, r in w.items()}
    ests["FSDP x2"] = {"state": 110 * mib, "step": 100 * mib}  # 1.25 on the state
    text = "\n".join(tp_memory.tables(w, ests) + tp_memory.verdicts(w, ests))
    assert "| TP2 | 2 | 55.0 | 0.55x | 55.0 | 1.00 | 61.0 | 0.55x | 61.0 | 1.00 |" in text
    assert "| FSDP x2 | 2 | 88.0 | 0.88x | 110.0 | 1.25 |" in text
    # parts from the rank of the largest state peak; the others: each largest over the ranks
    assert "| TP2 | 13.8 | 0.0 | 13.8 | 0.0 | 27.5 | 44.0 | 0.55x | 7.0 | 0.0 |" in text
    assert "- TP2: parameters + gradients + optimizer state <= 0.6x the unsharded stage: met " \
           "(0.55x)" in text  # fmt: skip
    assert "- FSDP x2: parameters + gradients + optimizer state <= 0.6x the unsharded stage: " \
           "**missed** (0.88x)" in text  # fmt: skip
    assert "**missed** (9 of 10 within; outside, est / meas: FSDP x2 state 1.25)" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp_memory_runs_at_tiny_size(tmp_path):
    import tp_memory

    out = tmp_path / "tp_memory.md"
    out.write_text("# old\n\n## Analysis\n\nkept across runs\n")
    got = tp_memory.main(["--tiny", "--out", str(out)])
    rows, ests = got["rows"], got["estimates"]
    assert set(rows) == set(tp_memory.CONFIGS)
    base = rows[tp_memory.BASE]
    # one unsharded rank: the cost model's 16 bytes per parameter is what the tracker sees
    assert ests[tp_memory.BASE]["state"] == pytest.approx(base["state_peak"], rel=0.01)
    assert rows["TP2"]["state_peak"] < 0.75 * base["state_peak"]  # the blocks are cut
    assert rows["TP2 x FSDP2"]["state_low"] < 0.4 * base["state_low"]  # and sharded
    text = out.read_text()
    assert text.startswith("# Per-rank memory") and "## Goals" in text
    assert text.rstrip().endswith("## Analysis\n\nkept across runs")


def test_fidelity_replays_its_saved_inputs(tmp_path: Path) -> None:
    """A saved run (a real 2-core run's inputs, tests/data) is re-predicted offline: the
    measured column is the run's own and the predictions come from this checkout's model."""
    import json
    import statistics

    from dapple.core.cluster import Cluster
    from dapple.core.plan import Plan
    from dapple.core.profile import ModelProfile
    from dapple.cost.pipeline import pipeline_latency
    from fidelity import label, main

    saved = Path(__file__).parent / "data" / "fidelity-2cores.inputs.json"
    inp = json.loads(saved.read_text())
    out = tmp_path / "replay.md"
    assert main(["--replay", str(saved), "--out", str(out)]) == 0
    text = out.read_text()
    assert "- replayed: `python benchmarks/fidelity.py --replay" in text
    profile = ModelProfile.from_dict(inp["profile"])
    cluster = Cluster.from_dict(inp["cluster"])
    for plan_d, times in zip(inp["plans"], inp["times"], strict=True):
        plan = Plan.from_dict(plan_d)
        L = pipeline_latency(plan, profile, cluster).L_ms
        meas = statistics.median(times)
        row = f"| {label(plan)} | {meas:.1f} | "
        assert row in text
        assert f"| {L:.1f} (" in text.split(row)[1].split("\n")[0]


def test_step_gc_syscalls_counts_only_the_window():
    from step_gc_syscalls import _syscalls, render

    log = "\n".join([
        '11 getrusage(RUSAGE_SELF, {...}) = 0',  # before the window: not counted
        '11 write(5, "STEP-WINDOW-BEGIN\\n", 18) = 18',
        '12 epoll_wait(7, [], 64, 1000) = 0',
        '11 getrusage(RUSAGE_SELF, {...}) = 0',
        '12 epoll_wait(7, [], 64, 1000) = 0',
        '11 write(5, "STEP-WINDOW-END\\n", 16) = 16',
        '11 brk(NULL) = 0x55',
    ])  # fmt: skip
    assert _syscalls(log) == {"epoll_wait": 2, "getrusage": 1}
    res = {"collections": [1, 0, 0], "gc_ms": [0.5, 0.0, 0.0], "steps": 2, "tracked": 1234,
           "full_ms": 180.4}  # fmt: skip
    lines = render({"dapple": {**res, "syscalls": {"epoll_wait": 2, "getrusage": 1}},
                    "plain": {**res, "syscalls": None}})  # fmt: skip
    assert (
        "| dapple | 2 | 1 (0.5 ms), 0 (0.0 ms), 0 (0.0 ms) | 1,234 / 180 ms "
        "| 1.50: epoll_wait 1.00, getrusage 0.50 |" in lines
    )
    assert (
        "| plain | 2 | 1 (0.5 ms), 0 (0.0 ms), 0 (0.0 ms) | 1,234 / 180 ms | strace not installed |"
        in lines
    )


def test_step_gap_renders_each_part_and_the_paired_ratio():
    from step_gap import render

    run = {"plain F": [4.0, 4.0], "plain B": [5.0, 5.0], "plain rest": [1.0, 1.0],
           "dapple F": [4.0, 4.0], "dapple B": [5.5, 5.5], "dapple rest": [1.5, 1.5]}  # fmt: skip
    lines = render({"shipped": [run]}, "cmd", ["load a", "load b"])
    assert "| shipped | B | 5.000 | 5.500 | +0.500 | +5.0% |" in lines
    assert "| shipped | rest | 1.000 | 1.500 | +0.500 | +5.0% |" in lines
    step = next(line for line in lines if "**step**" in line)
    assert step.startswith("| shipped | **step** | 10.000 | 11.000 | +1.000 | paired ratio 0.909")


def test_step_gap_child_pairs_every_measured_step():
    from step_gap import PARTS, run_child

    out = run_child("tiny", "no norm, probe, tokens", 3)
    assert sorted(out) == sorted(f"{s} {p}" for s in ("plain", "dapple") for p in PARTS)
    assert all(len(v) == 3 and min(v) >= 0 for k, v in out.items() if not k.endswith("rest"))
    assert all(len(out[f"{s} rest"]) == 3 for s in ("plain", "dapple"))
