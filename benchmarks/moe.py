"""dapple's plan with a per-stage expert-parallel width against the best uniform grid, on MoE models.

For each model and cluster size, four plans of the same analytic profile at the same global batch:

* **dapple (EP per stage)**: :func:`dapple.planner.search.dapple_search` (tensor widths 1/2/4/8,
  interleaved 1F1B offered), run with ZeRO 0 and ``auto``, the better L kept; each MoE stage of
  tensor width 1 may shard its experts over e_s of its replicas
  (:mod:`dapple.planner.expert_width`);
* **dapple, no EP**: the same search with no expert width offered (``experts=False``), so its
  difference to the first is what the per-stage width adds (the first runs this search too and
  keeps the better plan, :func:`~dapple.planner.expert_width.with_and_without_widths`: its
  planning time is both searches');
* **uniform grid**: the best of the torchtitan-style grid (:mod:`dapple.planner.grid`: dp x tp x
  pp, DDP or FSDP, 1F1B or interleaved) and of the uniform EP x PP x DP grid (every MoE stage
  at one width e, :mod:`dapple.planner.expert_grid`), by L;
* **uniform EP grid**: the best point of the latter alone.

Each plan is simulated (:func:`dapple.simulate.simulate`): step time, peak memory per device.
Profiles are analytic (``analytic_profile(model, "h100", precision="bf16", recompute=...)``
without and with full activation checkpointing, :data:`CHECKPOINTS`, the model's own sequence
length), the cluster the ``h100-8x`` preset with more servers; the global batch is
:data:`SAMPLES_PER_GPU` x GPUs.

Usage: ``python benchmarks/moe.py [--out benchmarks/moe.md] [--cases mixtral-8x7b:8 ...]``
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from _bench_common import header, write_report
from dapple.core.cluster import GIB, Cluster
from dapple.core.cluster_presets import PRESETS
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import InfeasibleError
from dapple.planner.expert_grid import expert_grid_candidates, uniform_expert_grid_plan
from dapple.planner.search import dapple_search
from dapple.profiler.analytic import analytic_profile
from dapple.simulate import simulate

SAMPLES_PER_GPU = 4
"""Samples per GPU per step: 4 x 4,096 tokens, about 4M tokens per step on 256 GPUs."""

CASES = (
    "mixtral-8x7b:8",
    "mixtral-8x7b:32",
    "qwen2-57b-a14b:8",
    "qwen2-57b-a14b:32",
    "deepseek-v3:64",
)
"""``model:servers`` (8 H100 each) run by default."""

ZERO_STAGES: tuple[int | str, ...] = (0, "auto")
"""dapple's search runs once per zero choice; the plan of least L is kept."""

CHECKPOINTS = ("none", "full")
"""The activation checkpointing profiles every planner chooses from (the plan of least L wins):
the grid re-computes only as its profile does, and a point that holds its 1F1B micro-batches
only under full checkpointing is one a torchtitan user would run."""


@dataclass(frozen=True, slots=True)
class Side:
    """One planner's plan, planned and simulated (``plan`` None: nothing fits, NaN numbers)."""

    name: str
    plan: Plan | None
    checkpoint: str
    """The activation checkpointing profile it was planned with (:data:`CHECKPOINTS`)."""
    label: str
    planning_s: float
    """Wall seconds of planning (every checkpointing profile)."""
    planning_cpu_s: float
    """This process's CPU seconds of the same (user + system; the load does not inflate it)."""
    L_ms: float
    step_ms: float
    peak_gib: float


@dataclass(frozen=True, slots=True)
class Case:
    model: str
    gpus: int
    B: int
    sides: tuple[Side, ...]


def shape(plan: Plan) -> str:
    """Per stage ``layers r x t e z`` as text, e.g. ``[0,5) 8x1 e8``, ``; ``-joined."""
    parts = []
    for st in plan.stages:
        t = f"x{st.tensor_width}" if st.tensor_width > 1 else ""
        e = f" e{st.expert_width}" if st.expert_width > 1 else ""
        z = f" z{st.zero_stage}{'r' if st.regather else ''}" if st.zero_stage else ""
        parts.append(f"[{st.layers[0]},{st.layers[1]}) {st.replicas}{t}{e}{z}")
    sched = plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return f"M={plan.num_micro_batches} {sched}: " + "; ".join(parts)


Planner = Callable[[ModelProfile, Cluster, int], "tuple[Plan, str] | None"]
"""A plan and its label (empty: :func:`shape`) of a profile on a cluster at a global batch."""


def _side(
    name: str, planner: Planner, profiles: dict[str, ModelProfile], cl: Cluster, B: int
) -> Side:
    """``planner``'s plan of least L over the checkpointing ``profiles``, simulated."""
    t0, c0 = time.perf_counter(), time.process_time()
    got = [(ac, planner(prof, cl, B)) for ac, prof in profiles.items()]
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    found = [(ac, x[0], x[1]) for ac, x in got if x is not None]
    if not found:
        return Side(name, None, "-", "no point fits", seconds, cpu, math.nan, math.nan, math.nan)
    ac, plan, label = min(found, key=lambda x: x[1].predicted_step_ms)
    sim = simulate(plan, profiles[ac], cl)
    peak = max(d.peak_memory_bytes for d in sim.devices) / GIB
    return Side(name, plan, ac, label or shape(plan), seconds, cpu, plan.predicted_step_ms,
                sim.step_ms, peak)  # fmt: skip


def _dapple(experts: bool | None) -> Planner:
    def plan(prof: ModelProfile, cl: Cluster, B: int) -> tuple[Plan, str] | None:
        plans = []
        for z in ZERO_STAGES:
            try:
                plans.append(
                    dapple_search(prof, cl, B, zero_stage=z, interleaved=True, experts=experts)
                )
            except InfeasibleError:
                continue
        return (min(plans, key=lambda p: p.predicted_step_ms), "") if plans else None

    return plan


def _grid(prof: ModelProfile, cl: Cluster, B: int) -> tuple[Plan, str] | None:
    try:
        plan, label = uniform_expert_grid_plan(prof, cl, B)
    except InfeasibleError:
        return None
    return plan, label


def _ep_grid(prof: ModelProfile, cl: Cluster, B: int) -> tuple[Plan, str] | None:
    cands = expert_grid_candidates(prof, cl, B)
    if not cands:
        return None
    best = min(cands, key=lambda c: c.L_ms)
    return best.plan, best.label


def compare(model: str, servers: int) -> Case:
    """Plan ``model`` on ``servers`` H100 servers four ways (module docstring), simulate each."""
    profiles = {
        ac: analytic_profile(model, "h100", precision="bf16", recompute=ac) for ac in CHECKPOINTS
    }
    cl = PRESETS["h100-8x"].with_servers(servers)
    B = SAMPLES_PER_GPU * cl.num_devices
    sides = (
        _side("dapple (EP per stage)", _dapple(None), profiles, cl, B),
        _side("dapple, no EP", _dapple(False), profiles, cl, B),
        _side("uniform grid", _grid, profiles, cl, B),
        _side("uniform EP grid", _ep_grid, profiles, cl, B),
    )
    return Case(model, cl.num_devices, B, sides)


def case_lines(c: Case) -> list[str]:
    d, grid = c.sides[0], c.sides[2]
    lines = [
        f"### {c.model} on {c.gpus} H100, global batch {c.B}",
        "",
        "| plan | L ms | simulated ms | peak GiB | planning wall s | planning CPU s | checkpointing "
        "| layout |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for s in c.sides:
        lines.append(
            f"| {s.name} | {s.L_ms:,.0f} | {s.step_ms:,.0f} | {s.peak_gib:.1f} | "
            f"{s.planning_s:.1f} | {s.planning_cpu_s:.1f} | {s.checkpoint} | {s.label} |"
        )
    lines += [
        "",
        f"dapple / uniform grid: {grid.L_ms / d.L_ms:.3f}x by L, "
        f"{grid.step_ms / d.step_ms:.3f}x simulated.",
        "",
    ]
    return lines


def summary_lines(cases: Sequence[Case]) -> list[str]:
    lines = [
        "| model | GPUs | B | dapple ms | dapple no-EP ms | uniform grid ms | uniform EP grid ms "
        "| speed-up vs grid (L / simulated) | EP widths in dapple's plan |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for c in cases:
        d, n, g, e = c.sides
        widths = sorted({st.expert_width for st in d.plan.stages}) if d.plan else []
        lines.append(
            f"| {c.model} | {c.gpus} | {c.B} | {d.step_ms:,.0f} | {n.step_ms:,.0f} | "
            f"{g.step_ms:,.0f} | {e.step_ms:,.0f} | {g.L_ms / d.L_ms:.3f}x / "
            f"{g.step_ms / d.step_ms:.3f}x | {', '.join(map(str, widths))} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file to write")
    ap.add_argument("--cases", nargs="+", default=list(CASES), help="model:servers")
    args = ap.parse_args(argv)
    command = "python benchmarks/moe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    cases = []
    for text in args.cases:
        model, servers = text.split(":")
        cases.append(compare(model, int(servers)))
        print(f"done {text}", file=sys.stderr)
    lines = header("dapple's per-stage expert parallelism vs the uniform grid (MoE, H100)", command)
    lines += [
        "Numbers are analytic (cost model and simulator, no GPU); ms are one training step. "
        "Step times in the summary are simulated.",
        "",
        "## Summary",
        "",
        *summary_lines(cases),
        "",
    ]
    for c in cases:
        lines += case_lines(c)
    write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
