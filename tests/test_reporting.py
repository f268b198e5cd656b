"""What a run shows: the per-step line and JSON keys, tokens/s, TensorBoard scalars, the loss
curve, the progress bar, and ``dapple train`` with the evaluation and reporting flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapple.core.plan import straight_plan
from dapple.runtime import StepMetrics, TrainConfig
from dapple.runtime.metrics import MetricsSink, step_metrics
from dapple.runtime.reporting import (
    ProgressBar,
    TensorBoardWriter,
    open_reporters,
    scalars,
    target_tokens,
    write_loss_curve,
)

TESTS = Path(__file__).parent
ROWS = [[-1, 0, -1, 0, 0.0, 100], [-1, 1, -1, 1, 0.75, 50]]


def _metrics(step: int, **kw) -> StepMetrics:
    base = dict(step=step, loss=1.0 / (step + 1), step_ms=20.0, samples_per_s=400.0,
                peak_memory_bytes=(2048, 10), memory_kind="held_activations")  # fmt: skip
    return StepMetrics(**{**base, **kw})


def test_step_line_shows_the_optional_fields_only_when_present() -> None:
    plain = _metrics(0).line()
    assert "lr" not in plain and "grad_norm" not in plain and "eval_loss" not in plain
    assert "tokens/s" not in plain and "400.0 samples/s" in plain
    full = _metrics(3, lr=3e-4, grad_norm=1.25, eval_loss=0.5, tokens_per_s=12345.6).line()
    assert full.startswith("step 3 loss 0.250000 lr 0.0003 grad_norm 1.25 eval_loss 0.500000 ")
    assert "time 20.0 ms 400.0 samples/s 12346 tokens/s peak[held_activations] s0=2.0KiB" in full


def test_target_tokens_counts_integer_token_targets_only() -> None:
    assert target_tokens(torch.zeros(4, 7, dtype=torch.long)) == 28
    assert target_tokens(torch.zeros(4, dtype=torch.long)) is None  # one label per sample
    assert target_tokens(torch.zeros(4, 7)) is None  # regression targets


def test_step_metrics_tokens_per_s_and_eval_loss() -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2)
    m = step_metrics(plan, 5, ROWS, 40.0, "x", None, target_tokens=800, eval_loss=0.3)
    assert m.tokens_per_s == pytest.approx(800 / 0.04) and m.eval_loss == 0.3
    assert m.samples_per_s == pytest.approx(8 / 0.04)
    none = step_metrics(plan, 5, ROWS, 40.0, "x", None)
    assert none.tokens_per_s is None and none.eval_loss is None


def test_json_lines_carry_the_optional_keys(tmp_path: Path) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2)
    path = tmp_path / "m.jsonl"
    sink = MetricsSink(plan, TrainConfig(metrics_path=str(path)), rank=0, memory_kind="x")
    sink.record(0, ROWS, 40.0, target_tokens=80)
    sink.record(1, ROWS, 40.0, eval_loss=0.5)
    sink.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        assert {"lr", "grad_norm", "eval_loss", "tokens_per_s"} <= r.keys()
    assert rows[0]["tokens_per_s"] == pytest.approx(2000.0) and rows[0]["eval_loss"] is None
    assert rows[1]["eval_loss"] == 0.5 and rows[1]["tokens_per_s"] is None


def test_scalars_leave_out_missing_fields() -> None:
    assert set(scalars(_metrics(0))) == {"train/loss", "perf/samples_per_s", "perf/step_ms"}
    full = scalars(_metrics(0, lr=0.1, grad_norm=2.0, eval_loss=0.4, tokens_per_s=9.0))
    assert full["train/lr"] == 0.1 and full["eval/loss"] == 0.4 and len(full) == 7


def test_tensorboard_writer_writes_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = TensorBoardWriter(str(tmp_path))
    for t in range(3):
        w(_metrics(t, eval_loss=0.5 if t == 2 else None, tokens_per_s=100.0 + t))
    w.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "perf/tokens_per_s", "perf/step_ms"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1, 2]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(2, 0.5)]


def test_loss_curve_png(tmp_path: Path) -> None:
    ms = [_metrics(t, eval_loss=0.2 if t % 2 else None) for t in range(4)]
    out = write_loss_curve(ms, tmp_path / "curve.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000


def test_progress_bar_only_on_rank_0_and_a_terminal(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=3, progress=True, tensorboard_dir=str(tmp_path))
    assert open_reporters(cfg, rank=1, start=0) == []
    reporters = open_reporters(cfg, rank=0, start=0)  # pytest's stdout is not a terminal
    assert [type(r) for r in reporters] == [TensorBoardWriter]
    for r in reporters:
        r.close()
    bar = ProgressBar(3, start=1)  # runs off a terminal too (draws nothing there)
    bar(_metrics(1, eval_loss=0.3))
    bar.close()


# -- dapple train with the flags -------------------------------------------------------------
def _dapple(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "dapple", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


TINY_LM = ["--model", "transformer", "--set", "layers=2", "--set", "hidden=16",
           "--set", "heads=2", "--set", "seq=8", "--set", "vocab=32"]  # fmt: skip


@pytest.mark.slow
def test_train_cli_evaluates_and_reports(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(tmp_path / "p.json")
    args = ["train", "--plan", str(tmp_path / "p.json"), *TINY_LM, "--steps", "3",
            "--eval-every", "2", "--eval-batches", "2", "--metrics", str(tmp_path / "m.jsonl"),
            "--tensorboard", str(tmp_path / "tb"), "--timeout-s", "60"]  # fmt: skip
    proc = _dapple(args)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows]
    assert evals[0] is None and evals[1] > 0 and evals[2] > 0  # after step 1 and the last
    assert all(r["tokens_per_s"] > 0 for r in rows)  # 4 samples x 8 target tokens per step
    out = proc.stdout.splitlines()
    steps = [line for line in out if line.startswith("step ")]
    assert len(steps) == 3 and "eval_loss" in steps[1] and "eval_loss" not in steps[0]
    assert all("tokens/s" in line for line in steps)
    assert f"final train loss {rows[-1]['loss']:.6f} (step 2)" in out
    assert f"last validation loss {evals[2]:.6f} (after step 2)" in out
    curve = tmp_path / "m.loss.png"  # default: beside the metrics file
    assert f"loss curve written to {curve}" in out
    assert curve.read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_train_cli_rejects_bad_eval_flags_before_launch(tmp_path: Path) -> None:
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(tmp_path / "p.json")
    base = ["train", "--plan", str(tmp_path / "p.json"), *TINY_LM]
    for flags, msg in (
        (["--eval-every", "-1"], "--eval-every must be >= 0, got -1"),
        (["--eval-batches", "0"], "--eval-batches must be >= 1, got 0"),
        (["--loss-curve", str(tmp_path / "p.json" / "c.png")], "is a file, not a directory"),
    ):
        proc = _dapple(base + flags)  # a hang guard only: the message says it came first
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
        assert proc.stderr.startswith("dapple: error: ") and msg in proc.stderr
