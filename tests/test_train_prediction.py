"""A run's prediction is made once, by :func:`dapple.api.train`: the simulated step time goes
into every step's metrics, the planner's memory estimate per device group into the last one's
``extra``, and ``dapple train``'s memory table prints those numbers (the runtime stubbed)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dapple import api
from dapple.api.running import PLANNED_MEMORY
from dapple.cli import main
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan, straight_plan
from dapple.cost.pipeline import pipeline_latency
from dapple.profiler.paper_models import load_profile
from dapple.runtime.step_metrics import StepMetrics
from dapple.runtime.train_config import TrainConfig, state_factor

MIB = 2**20
# resnet50's paper profile has 18 layers; mlp(layers=17) too (17 hidden + classifier)
PROFILE, CLUSTER, MODEL = "paper:resnet50", "paper-b", {"layers": 17}


def _plan() -> Plan:
    return straight_plan(18, [0, 9], global_batch_size=4, num_micro_batches=2)


def _steps(config: TrainConfig) -> list[StepMetrics]:
    """Two steps as the runtime reports them, with the config's prediction."""
    return [
        StepMetrics(step=s, loss=1.0, step_ms=5.0, samples_per_s=1.0,
                    peak_memory_bytes=(1 * MIB, 2 * MIB), memory_kind="held_activations",
                    predicted_step_ms=config.predicted_step_ms,
                    peak_resident_bytes=(300 * MIB, 301 * MIB),
                    stage_resident_bytes=(40 * MIB, 60 * MIB), resident_kind="VmHWM")
        for s in range(config.steps)
    ]  # fmt: skip


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    """The runtime stubbed: each run's config is kept and its two steps returned."""
    got: list[TrainConfig] = []

    def fake(plan: Plan, workload: Any, config: TrainConfig, **_: Any) -> list[StepMetrics]:
        got.append(config)
        return _steps(config)

    monkeypatch.setattr("dapple.runtime.train", fake)
    return got


def _expected_memory(optimizer: str) -> list[float]:
    """The cost model's per-replica memory of each stage with ``optimizer``'s state."""
    prof = dataclasses.replace(
        load_profile(PROFILE), optimizer_state_factor=state_factor(optimizer, 0.0)
    )
    rows = pipeline_latency(_plan(), prof, load_cluster(CLUSTER)).stages
    return [float(r.memory_bytes) for r in rows if r.kind == "compute"]


def test_api_train_returns_the_planned_memory_with_the_last_step(runs: list[TrainConfig]) -> None:
    kw: dict[str, Any] = {"overrides": MODEL, "device": "cpu", "optimizer": "adamw"}
    got = api.train(_plan(), "mlp", 2, profile=PROFILE, cluster=CLUSTER, **kw)
    expected = _expected_memory("adamw")
    assert len(expected) == 2 and expected != _expected_memory("sgd")
    assert got[-1].extra == {PLANNED_MEMORY: expected}
    assert got[0] == _steps(runs[0])[0]  # the other steps as the runtime reported them
    assert got[0].predicted_step_ms == runs[0].predicted_step_ms
    assert got[0].predicted_step_ms is not None and got[0].predicted_step_ms > 0
    assert api.train(_plan(), "mlp", 2, **kw)[-1].extra == {}  # no profile: no prediction


def test_dapple_train_prints_the_memory_the_api_returned(
    tmp_path: Path,
    runs: list[TrainConfig],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("dapple.cli.train_cmd._early_workers", lambda *_: contextlib.nullcontext())
    monkeypatch.setenv("COLUMNS", "200")
    _plan().save(tmp_path / "p.json")
    argv = ["train", "--plan", str(tmp_path / "p.json"), "-m", "mlp", "--set", "layers=17"]
    argv += ["--profile", PROFILE, "--cluster", CLUSTER, "--device", "cpu", "--steps", "2"]
    assert main([*argv, "--optimizer", "adam"]) == 0
    out = capsys.readouterr().out
    assert "memory per replica (planner: adam state, K_i in flight)" in out
    row = [line for line in out.splitlines() if line.startswith("│     1 ")]
    estimate = _expected_memory("adam")[1]
    assert len(row) == 1 and f"{estimate / MIB:.1f} MiB" in row[0], out
