"""The GPU check v2's CPU dry run (``benchmarks/gpu_check.sh --dry-run``): every GPU step runs on
the CPU at tiny shapes and writes the files the GPU run writes; the CPU steps check their
command lines. 2-6 minutes on this project's 2 shared cores (5 min 8 s at load
average 9-10; 2 min 42 s quiet, 3 min 11 s of CPU time). In the fast tier: CI runs the dry run
on every stop (issue 41)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

GPU_STEPS = ("versions", "realistic", "layers", "trace", "vs_plain", "verify", "profile")
CPU_STEPS = ("cpu_fidelity", "cpu_pipelining")


def _statuses(report: str) -> dict[str, str]:
    """The step table's ``step -> status`` (the report's first table)."""
    lines = report.split("| step | status | seconds | limit s |\n|---|---|---|---|\n")[1]
    rows = lines.split("\n\n")[0].splitlines()
    return {row.split("|")[1].strip(): row.split("|")[2].strip() for row in rows}


@pytest.mark.timeout(1800)
def test_the_dry_run_runs_every_step_and_writes_its_inputs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    check_output(tmp_path)


def check_output(tmp_path: Path) -> None:
    """Every step ok; the files a GPU run writes are there, packed, and parse."""
    gpu, cpu = (tmp_path / "gpu.md").read_text(), (tmp_path / "cpu.md").read_text()
    assert _statuses(gpu) == dict.fromkeys(GPU_STEPS, "ok"), gpu[:3000]
    assert _statuses(cpu) == dict.fromkeys(CPU_STEPS, "ok"), cpu[:3000]
    assert f"| torch | {torch.__version__} |" in gpu
    assert "dapple speed / plain" in gpu and "Self CPU" in gpu

    work = tmp_path / "gpu"
    with tarfile.open(tmp_path / "gpu.tar.gz") as tar:
        packed = {Path(n).name for n in tar.getnames()}
    expected = {"calibration.json", "layers.json", "realistic_memory.json",
                "realistic_times.json", "plan_1stage.json", "plan_1to1.json",
                "trace_plain.txt", "trace_dapple.txt", "trace_plain.json", "trace_dapple.json",
                "trace_pieces.txt", "trace_pieces.json",
                "profile_llama38b_measured.json", "profile_llama38b_analytic_h100.json",
                "profile_zoo_measured.json", "profile_gpt2_measured.json", "config.json",
                "cluster_h100-8x.json", "gpu.md"}  # fmt: skip
    assert expected <= packed, expected - packed
    assert expected - {"config.json"} <= {p.name for p in work.iterdir()}

    for p in work.glob("profile_*.json"):
        assert ModelProfile.load(p).layers, p
    for p in work.glob("cluster_*.json"):
        assert isinstance(load_cluster(str(p)), Cluster)
    assert Plan.load(work / "plan_1to1.json").num_stages == 2
    cal = json.loads((work / "calibration.json").read_text())
    assert cal["gemm_bf16_flops_per_s"] > 0 and "h100" in cal["datasheets"]
    rows = json.loads((work / "layers.json").read_text())
    assert {r["model"].split()[0] for r in rows} == {"Llama-3-8B", "GPT-2", "zoo"}
    assert all(r["measured_f_ms"] > 0 and r["h100_f_ms"] > 0 for r in rows)
    assert any("attention=causal" in r["model"] for r in rows)
    assert (work / "profile_llama38b_causal_measured.json").is_file()
    memory = json.loads((work / "realistic_memory.json").read_text())
    assert [(m["plan"], m["stage"]) for m in memory] == [("1 stage", 0), ("1:1", 0), ("1:1", 1)]
    assert all(v > 0 for m in memory for v in m["planned_mib"].values())
    times = json.loads((work / "realistic_times.json").read_text())
    assert all(times[f"{w}_step_ms"] for w in ("plain", "pieces", "dapple", "dapple_causal")), times
    assert "dapple / pieces" in gpu
    census = [r for r in gpu.splitlines() if r.startswith(("| plain HF |", "| traced pieces |"))]
    assert {r.split("|")[1].strip() for r in census} == {"plain HF", "traced pieces"}, census
    assert all("attention" in r.split("|")[2] and int(r.split("|")[3]) > 0 for r in census)
    for who in ("plain", "pieces", "dapple"):
        assert "Self CPU" in (work / f"trace_{who}.txt").read_text()
        assert json.loads((work / f"trace_{who}.json").read_text())["traceEvents"]
