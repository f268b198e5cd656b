"""``dapple demo``: its corpus, its plans and why, and the whole job end to end on a short run
(corpus, plan, train an uneven pipeline, validate, generate, the planner's choice on the same
batches, verify)."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from builders import make_cluster, make_profile
from dapple.cli import main
from dapple.cli._demo_corpus import stdlib_sources, unigram_entropy
from dapple.cli._demo_plan import cost, why
from dapple.cli._demo_run import median_step_ms, one_thread, run_progress
from dapple.cli.demo_cmd import _close
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, straight_plan
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.planner import make_plan
from dapple.planner.uneven import is_uneven_pipeline, uneven_pipeline


def test_unigram_entropy_of_known_distributions() -> None:
    assert unigram_entropy(np.array([7, 7, 7]), 256) == 0.0
    assert unigram_entropy(np.array([0, 1, 2, 3]), 256) == pytest.approx(np.log(4))


def test_stdlib_sources_stop_at_the_limit() -> None:
    files = stdlib_sources(200_000)
    assert files and all(p.suffix == ".py" for p in files)
    assert sum(p.stat().st_size for p in files[:-1]) <= 200_000


# -- the plans -----------------------------------------------------------------------------------
SHARED = dataclasses.replace(
    make_cluster(), compute_cores_per_server=1.0, step_overhead_ms=2.0, action_overhead_ms=0.3
)
"""4 processes sharing one core's worth of compute, each with host CPU overheads: the planner
picks one process."""


def _straight(cut: int, replicas: list[int], M: int = 2) -> Plan:
    """The 6-layer toy as one stage, or two cut before layer ``cut``; a global batch of 8."""
    bounds = [0, cut] if len(replicas) == 2 else [0]
    return straight_plan(6, bounds, global_batch_size=8, num_micro_batches=M, replicas=replicas)


def test_is_uneven_pipeline() -> None:
    assert is_uneven_pipeline(_straight(4, [3, 1]), 4)
    assert not is_uneven_pipeline(_straight(3, [2, 2]), 4)  # even
    assert not is_uneven_pipeline(_straight(4, [2, 1]), 4)  # not all 4 processes
    assert not is_uneven_pipeline(_straight(0, [4], M=1), 4)  # no pipeline
    assert not is_uneven_pipeline(_straight(4, [3, 1], M=1), 4)  # M < S: one stage at a time


@pytest.mark.parametrize("cluster", [make_cluster(), SHARED], ids=["dedicated", "one-core"])
def test_uneven_pipeline_beats_every_two_stage_uneven_plan(cluster: Cluster) -> None:
    """Against every 3:1 and 1:3 plan at every cut and M >= 2, costed by pipeline_latency."""
    prof, G = make_profile(6), 8
    plan = uneven_pipeline(prof, cluster, G)
    assert is_uneven_pipeline(plan, 4) and plan.num_micro_batches >= plan.num_stages
    assert plan.predicted_step_ms >= make_plan(prof, cluster, G).predicted_step_ms  # constrained
    for reps in ([3, 1], [1, 3]):
        for cut in range(1, 6):
            for M in (2, 4, 8):
                other = _straight(cut, reps, M)
                assert plan.predicted_step_ms <= pipeline_latency(other, prof, cluster).L_ms + 1e-9


def test_uneven_pipeline_needs_three_devices() -> None:
    with pytest.raises(ValidationError, match="at least 3 devices"):
        uneven_pipeline(make_profile(6), make_cluster(per_server=2), 8)


def test_why_names_the_candidates_and_what_limited_the_choice() -> None:
    prof, G = make_profile(6), 8
    choice = cost("dapple", make_plan(prof, SHARED, G), prof, SHARED)
    trained = cost("uneven", uneven_pipeline(prof, SHARED, G), prof, SHARED)
    dp = cost("dp", make_plan(prof, SHARED, G, "dp"), prof, SHARED)
    head, limits = why(choice, trained, [dp], SHARED)
    assert choice.label == "1 process"
    assert head.startswith(f"why: dapple chose 1 of 4 processes, predicted {choice.step_ms:.1f} ms")
    assert f"than {trained.label} (uneven, {trained.step_ms:.1f} ms)" in head
    assert "DP x4 (dp," in head
    assert "compute: calibration measured 1.00" in limits and "beyond 1 computing" in limits
    assert "memory: peak" in limits and "no limit" in limits
    assert "host CPU: each process spends 2 ms per step" in limits
    assert f"{trained.label} adds" in limits


def test_demo_refuses_fewer_than_three_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--nproc", "2", "--out-dir", str(tmp_path)]) == 2
    assert "needs at least 3 processes" in capsys.readouterr().err


# -- running the jobs ----------------------------------------------------------------------------
def test_run_progress_reads_the_steps_from_the_metrics_file(tmp_path: Path) -> None:
    """Off a terminal: a line at the start, the last step's loss, and the closing count."""
    out, metrics = io.StringIO(), tmp_path / "metrics.jsonl"
    metrics.write_text('{"loss": 9.0}\n')  # an earlier run's: removed at the start
    with run_progress(Console(file=out), "train 3:1", 3, metrics):
        done = "".join(json.dumps({"step": i, "loss": 3.0 - i}) + "\n" for i in range(3))
        metrics.write_text(done + '{"lo')  # a line being written
    lines = out.getvalue().splitlines()
    assert lines[0] == "train 3:1: 0/3 0% elapsed 0.0 s eta ?"
    assert lines[-1].startswith("train 3:1: done 3/3 in"), lines


def test_one_thread_restores_the_thread_count() -> None:
    import torch

    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_median_step_ms_skips_the_first_steps() -> None:
    steps = [SimpleNamespace(step_ms=ms) for ms in (900.0, 10.0, 30.0, 20.0)]
    assert median_step_ms(steps, 1) == 20.0
    assert median_step_ms(steps[:1], 3) == 900.0  # a run shorter than the skip: all of it


# -- end to end ----------------------------------------------------------------------------------
def test_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In the fast tier (CI) on purpose: the README's main job, end to end."""
    out = tmp_path / "demo"
    args = ["demo", "--steps", "12", "--corpus-mib", "0.3", "--out-dir", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 12 and summary["eval_losses"]
    assert (out / "loss.png").is_file() and (out / "gantt.png").is_file()
    # the trained plan is a pipeline with uneven replication over the 4 processes, whatever
    # the planner chose; the planner's reason is printed
    plan = Plan.from_dict(summary["plan"])
    assert is_uneven_pipeline(plan, 4), plan.replication
    rep = plan.replication
    assert summary["why"][0].startswith("why: dapple chose") and "limits: " in summary["why"][1]
    assert summary["why"][0] in text and "memory: peak" in text
    assert f"3. train {rep}" in text and f"train {rep}: done 12/12 in" in text
    assert f"verify {rep}: done in" in text
    assert "OK: largest gradient difference" in text  # verify of the uneven pipeline passed
    if Plan.from_dict(summary["planner_choice"]) != plan:  # the choice ran on the same batches
        assert f"largest difference from the {rep} run's first step (same batches" in text
        assert re.search(r"step time of .*: predicted [0-9.]+ ms, measured [0-9.]+ ms", text)
    # off a terminal every long phase prints plain progress lines
    assert "profile transformer: done 24/24 in" in text and "calibrate: done in" in text
    assert "demo: every check passed in" in text
    assert "def __init__(self" in text  # the generated continuation
    assert "160 bytes sampled (seed 0):" in text and "greedy (argmax) continuation: " in text
    assert "the prediction rests on the profile" in text
    assert "…" not in text  # no line or table cut to fit 80 columns


@pytest.mark.slow
def test_demo_exits_nonzero_when_a_check_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify that fails (rank 1's gradients perturbed) makes the demo fail, not just say so."""
    from dapple.runtime.verify import PERTURB_GRAD_RANK_ENV

    monkeypatch.setenv(PERTURB_GRAD_RANK_ENV, "1")
    out = tmp_path / "demo"
    args = ["demo", "--steps", "4", "--corpus-mib", "0.1", "--out-dir", str(out)]
    assert main(args) == 1
    captured = capsys.readouterr()
    text = captured.out
    assert re.search(r"check failed: verify of [0-9:]+: stage \d: step 0 gradient of", text), text
    assert "check(s) failed" in text
    (line,) = captured.err.splitlines()[-1:]
    assert re.match(r"dapple: error: demo: \d+ check\(s\) failed: .*verify of [0-9:]+: ", line)


def test_a_failed_check_ends_with_one_error_line_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    con = Console(file=sys.stdout, soft_wrap=True)
    failed = ["validation loss 5.1 not below the unigram entropy 4.2", "verify of 2:1: MISMATCH"]
    assert _close(con, failed, 12.0) == 1
    out, err = capsys.readouterr()
    assert "check failed: validation loss 5.1" in out and "demo: 2 check(s) failed" in out
    assert err.splitlines() == [
        "dapple: error: demo: 2 check(s) failed: validation loss 5.1 not below the unigram "
        "entropy 4.2; verify of 2:1: MISMATCH"
    ]
    assert _close(con, [], 12.0) == 0
    out, err = capsys.readouterr()
    assert "demo: every check passed" in out and err == ""
