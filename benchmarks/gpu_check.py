"""The GPU check (v2): one prepared run that measures dapple's CUDA path, in two parts of under
10 minutes each, run by ``benchmarks/gpu_check.sh`` (README there: how to call it on the device,
how to carry a transformers wheel).

Part ``gpu`` (one GPU; steps in order of importance, so a short lease loses the least):

1. ``versions``: Python, torch, CUDA, NCCL, cuDNN, transformers against dapple's minimum, cores.
2. ``realistic``: Llama-3-8B shapes, 2 blocks, seq 4096, global batch 2: a plain HF loop and a
   plain loop over dapple's traced pieces vs dapple (1 stage; the traced model's attention
   masked, and causal); planned vs measured memory, 1 stage and 1:1 (:mod:`gpu_realistic`).
3. ``layers``: analytic vs measured time per layer, 3 models at width 4096 (the Llama with both
   attentions) (:mod:`gpu_layers`).
4. ``trace``: ``torch.profiler`` tables of one dapple step beside one plain HF step and one step
   of a plain loop over dapple's traced pieces; the attention kernels each model calls
   (:mod:`gpu_trace`).
5. ``vs_plain``, ``verify``, ``profile``: the first check's small-model steps (:mod:`gpu_small`).

Part ``cpu`` (no GPU; run pinned to its own cores by the shell script): ``cpu_fidelity``
(``benchmarks/fidelity.py``) and ``cpu_pipelining`` (``benchmarks/vs_torch_pipelining.py``),
4 processes each on its own share of the cores (``DAPPLE_PIN_CORES=1``).

Each step runs in its own process under its own limit (the ``LIMIT_*_S`` names below), and the
part under :data:`PART_BUDGET_S` in all: a step gets what is left of the budget if that is less
than its limit, and none when nothing is. After every step ``OUT/<part>.md`` is rewritten with
what is known so far, and ``OUT/<part>.tar.gz`` packs the part's folder (every input and output:
profiles, calibration, cluster, plans, configs, logs, tables).

``--dry-run`` (CI, no GPU): every GPU step runs on the CPU at tiny shapes (``gpu_common.TINY``);
the CPU steps check their benchmark's command line (each takes minutes).

    python benchmarks/gpu_check.py --out OUT [--part gpu|cpu|all] [--work DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]

import gpu_common  # noqa: E402
from gpu_common import SKIPPED, Ctx, context  # noqa: E402

# Step limits, seconds. The first GPU check's steps took (run1-gpu_check.md, H200): versions
# 9 s, verify 74 s, profile 83 s, vs_plain 52 s. The new steps are sized from run2-realistic.md
# (plain and dapple steps of ~120-135 ms, a 14 s profile, a 1:1 step of 436 ms) plus start-ups.
LIMIT_VERSIONS_S = 30
LIMIT_REALISTIC_S = 240
"""Four timed loops (plain HF, plain over the traced pieces, dapple masked and causal) in 2
rounds, then the memory plans (run2 on 2026-11-30 timed two loops and ran out of its 150 s in the
memory plans)."""
LIMIT_LAYERS_S = 130
"""Four measured profiles (the Llama twice: masked and causal attention), analytic twins."""
LIMIT_TRACE_S = 100
"""Three profiled sides of ~4 steps each and two model builds for the attention census."""
LIMIT_VS_PLAIN_S = 80
LIMIT_VERIFY_S = 110
LIMIT_PROFILE_S = 110
# CPU steps on 12 dedicated cores (run2-cpu-fidelity-12cores.md, run2-cpu-pipelining-partial.log):
# fidelity.py --rounds 2 --chunk 2 finished in 108 s; vs_torch_pipelining.py --rounds 2 --chunk 2
# had done 9 of its 2-process cases (about 100 s of steps) when its 200 s limit ended it, so it
# runs one round here.
LIMIT_CPU_FIDELITY_S = 220
LIMIT_CPU_PIPELINING_S = 300
PART_BUDGET_S = 560
"""Each part's steps in all: under the device's 10 minutes a command, with the script's
install and packing."""
DRY_LIMIT_S = 600
DRY_BUDGET_S = 1800
"""Every step's limit and the part's in a dry run: a hang ends there; a slow CI machine does
not (the slowest step took 86 s, the whole dry run 6 min, on 2 cores at load average 9-15;
CI runs it in its fast tier, often loaded, hence 7x the slowest step)."""

FIDELITY_ARGS = ["--rounds", "2", "--chunk", "2"]
PIPELINING_ARGS = ["--rounds", "1", "--chunk", "2", "--no-planned"]


@dataclass(frozen=True)
class Step:
    """One step: its function, its part, its limit, whether it needs CUDA."""

    run: Callable[[Ctx], list[str]]
    part: str
    limit_s: int
    cuda: bool = True


def _cpu_benchmark(script: str, args: list[str]) -> Callable[[Ctx], list[str]]:
    """A step that runs ``benchmarks/<script>`` with 4 processes pinned to their own cores; a dry
    run checks its command line only (the benchmarks take minutes on 2 shared cores)."""

    def step(ctx: Ctx) -> list[str]:
        report = ctx.path(f"{Path(script).stem}.md")
        cmd = [sys.executable, str(HERE / script), *args, "--out", str(report)]
        if ctx.dry:
            subprocess.run([*cmd, "--help"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            return [f"dry run: `{' '.join(cmd[1:])} --help` parsed; the benchmark runs without "
                    "--dry-run"]  # fmt: skip
        print("$", " ".join(cmd), f"(cores {gpu_common.cores()})", flush=True)
        subprocess.run(cmd, env={**os.environ, "DAPPLE_PIN_CORES": "1"}, check=True, cwd=ROOT)
        return [f"4 processes on cores {gpu_common.cores()}, each pinned to its own share: "
                f"`{report.name}` (its inputs beside it)", ""] + [
            line for line in report.read_text().splitlines() if line.startswith("|")
        ]  # fmt: skip

    return step


def _steps() -> dict[str, Step]:
    from gpu_layers import step_layers
    from gpu_realistic import step_realistic
    from gpu_small import step_profile, step_verify, step_versions, step_vs_plain
    from gpu_trace import step_trace

    return {
        "versions": Step(step_versions, "gpu", LIMIT_VERSIONS_S, cuda=False),
        "realistic": Step(step_realistic, "gpu", LIMIT_REALISTIC_S),
        "layers": Step(step_layers, "gpu", LIMIT_LAYERS_S),
        "trace": Step(step_trace, "gpu", LIMIT_TRACE_S),
        "vs_plain": Step(step_vs_plain, "gpu", LIMIT_VS_PLAIN_S),
        "verify": Step(step_verify, "gpu", LIMIT_VERIFY_S),
        "profile": Step(step_profile, "gpu", LIMIT_PROFILE_S),
        "cpu_fidelity": Step(_cpu_benchmark("fidelity.py", FIDELITY_ARGS), "cpu",
                             LIMIT_CPU_FIDELITY_S, cuda=False),
        "cpu_pipelining": Step(_cpu_benchmark("vs_torch_pipelining.py", PIPELINING_ARGS), "cpu",
                               LIMIT_CPU_PIPELINING_S, cuda=False),
    }  # fmt: skip


STEP_NAMES = ("versions", "realistic", "layers", "trace", "vs_plain", "verify", "profile",
              "cpu_fidelity", "cpu_pipelining")  # fmt: skip


def _summary(out: Path, part: str, names: list[str], results: dict[str, Any], dry: bool,
             work: Path) -> None:  # fmt: skip
    """Rewrite ``OUT/<part>.md`` (and pack the part's folder into ``OUT/<part>.tar.gz``)."""
    steps = _steps()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"# GPU check v2, part {part}" + (" (dry run: CPU, tiny shapes)" if dry else ""),
        "",
        f"- command: `bash benchmarks/gpu_check.sh {part}{' --dry-run' if dry else ''}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; cores "
        f"{gpu_common.cores()}; load average {load}",
        f"- every input and output: `{part}.tar.gz` (folder `{work.name}/`)",
        *(
            [
                "- a dry run checks that every step runs and writes its files: its numbers (tiny "
                "shapes, a shared CPU) measure nothing"
            ]
            if dry
            else []
        ),
        "",
        "| step | status | seconds | limit s |",
        "|---|---|---|---|",
    ]
    for name in names:
        r = results.get(name)
        status = r["status"] if r else "not run yet"
        secs = f"{r['seconds']:.0f}" if r else "-"
        limit = r["limit"] if r else steps[name].limit_s
        lines.append(f"| {name} | {status} | {secs} | {limit} |")
    for name in names:
        r = results.get(name)
        if r and r.get("lines"):
            lines += ["", f"## {name}", "", *r["lines"]]
    text = "\n".join(lines) + "\n"
    (out / f"{part}.md").write_text(text)
    (work / f"{part}.md").write_text(text)
    tmp = out / f".{part}.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname=work.name)
    tmp.replace(out / f"{part}.tar.gz")


def _run_step(name: str, work: Path, dry: bool, limit: float) -> dict[str, Any]:
    log = work / f"{name}.log"
    part = work / f"{name}.report.json"
    part.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--step", name, "--work", str(work)]
    cmd += ["--dry-run"] if dry else []
    t0 = time.perf_counter()
    with log.open("w") as f:  # a session of its own: a timeout ends its workers too
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        try:
            rc: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    dt = time.perf_counter() - t0
    text = log.read_text().strip().splitlines()
    lines = json.loads(part.read_text()) if part.exists() else []
    if rc == 0:
        status = "ok"
    elif rc == SKIPPED:
        status = text[-1] if text else "skipped"
    elif rc is None:
        status = f"timed out after {limit:.0f} s (partial output in {log.name})"
    else:
        status = f"failed (exit {rc}): {text[-1][:200] if text else ''} (see {log.name})"
    return {"status": status, "seconds": dt, "lines": lines, "limit": f"{limit:.0f}"}


def run_part(out: Path, work: Path, part: str, dry: bool) -> dict[str, Any]:
    """Run one part's steps in order under their limits and the part's budget."""
    steps = _steps()
    names = [n for n in STEP_NAMES if steps[n].part == part]
    if part == "cpu" and not dry:  # its own cores and versions (a dry run has them in gpu.md)
        names.insert(0, "versions")
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    start = time.perf_counter()
    budget = DRY_BUDGET_S if dry else PART_BUDGET_S
    for name in names:
        left = budget - (time.perf_counter() - start)
        limit = min(DRY_LIMIT_S if dry else steps[name].limit_s, left)
        if limit < 5:
            results[name] = {"status": f"not run: the part's {budget} s were spent",
                             "seconds": 0, "lines": [], "limit": "0"}  # fmt: skip
        else:
            print(f"== {name} (limit {limit:.0f} s)", flush=True)
            results[name] = _run_step(name, work, dry, limit)
        print(f"== {name}: {results[name]['status']} in {results[name]['seconds']:.0f} s",
              flush=True)  # fmt: skip
        _summary(out, part, names, results, dry, work)
    return results


def _one_step(name: str, work: Path, dry: bool) -> None:
    """Run one step in this process (the runner's child): its lines to ``WORK/<name>.json``."""
    step = _steps()[name]
    work.mkdir(parents=True, exist_ok=True)
    gpu_common.SINK = work / f"{name}.report.json"
    ctx = context(work, dry) if step.cuda else Ctx(work, dry, "cpu")
    lines = step.run(ctx)
    gpu_common.SINK.write_text(json.dumps(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="where OUT/<part>.md and OUT/<part>.tar.gz go")
    ap.add_argument("--part", choices=["gpu", "cpu", "all"], default="all")
    ap.add_argument("--work", help="the part's folder (default OUT/<part>)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (CI)")
    ap.add_argument("--step", choices=STEP_NAMES, help="run one step (internal)")
    args = ap.parse_args()
    if args.step:
        _one_step(args.step, Path(args.work), args.dry_run)
        return
    if not args.out:
        ap.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in ("gpu", "cpu") if args.part == "all" else (args.part,):
        work = Path(args.work) / part if args.work else out / part
        run_part(out, work, part, args.dry_run)
        print((out / f"{part}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
