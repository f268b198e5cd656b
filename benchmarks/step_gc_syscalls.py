"""Garbage collections and system calls per training step, dapple against a plain loop (issue 46).

Two costs a step can pay outside the instructions ``step_instructions.py`` counts and the
phases ``runtime_overhead.py`` times: Python's cyclic garbage collector (a full collection
walks every tracked object: the traced pieces, the modules, the plan) and system calls.
The tiny model of ``runtime_overhead.py`` (traced pieces, 1 stage, M = 4, fp32, fused AdamW,
metrics and the non-finite guard on) trains in one process per side:

- ``dapple``: :func:`dapple.runtime.run_plan`; the window is steps ``WARMUP`` to ``STEPS - 1``
  (from the end of one ``on_step`` to the start of the last);
- ``plain``: the plain loop over the same pieces (``runtime_overhead._plain_step``), the same
  steps.

Per side: the collections the window ran, per generation, with their time (``gc.callbacks``);
after the run, the objects the collector tracks and the time of one full collection (what a
generation-2 collection inside a step would cost);
and, when ``strace`` is on the machine, the system calls of every thread in the window, by name
(the process writes a marker line to ``os.devnull`` at each end of the window, which ``strace`` logs).

Usage::

    python benchmarks/step_gc_syscalls.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _bench_common import git_in, write_report

ROOT = Path(__file__).resolve().parent.parent
WARMUP, STEPS = 10, 60
_BEGIN, _END = "STEP-WINDOW-BEGIN", "STEP-WINDOW-END"
"""The window's marker lines, as the child writes them and as they stand in ``strace``'s log."""


def child(side: str) -> dict[str, Any]:
    """Train ``side`` and return its window's collections (count and ms per generation)."""
    import torch
    import torch.distributed as dist

    import runtime_overhead as ro

    torch.set_num_threads(ro.THREADS)
    size = ro.MODELS["tiny"]
    wl, _ = ro._model(size)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    counts, ms = [0, 0, 0], [0.0, 0.0, 0.0]
    state = {"on": False, "t0": 0.0}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            state["t0"] = time.perf_counter()
        elif state["on"]:
            counts[info["generation"]] += 1
            ms[info["generation"]] += (time.perf_counter() - state["t0"]) * 1e3

    marks = os.open(os.devnull, os.O_WRONLY)  # strace logs the write, whatever the file

    def window(begin: bool) -> None:
        os.write(marks, f"{_BEGIN if begin else _END}\n".encode())
        state["on"] = begin

    gc.callbacks.append(on_gc)
    if side == "plain":
        step = ro._plain_step(wl.build_model(ro.SEED + 1), wl, size, STEPS)
        for k in range(STEPS):
            if k == WARMUP:
                window(True)
            step(k)
        window(False)
    else:

        def on_step(m: Any) -> None:
            if m.step in (WARMUP - 1, STEPS - 1):
                window(m.step == WARMUP - 1)

        ro._dapple(wl, size, STEPS, on_step)
    tracked = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t0) * 1e3
    return {"collections": counts, "gc_ms": ms, "steps": STEPS - WARMUP,
            "tracked": tracked, "full_ms": full_ms}  # fmt: skip


def _syscalls(trace: str) -> Counter[str]:
    """System calls by name between the window's markers in an ``strace -f`` log."""
    out: Counter[str] = Counter()
    inside = False
    for line in trace.splitlines():
        if _BEGIN in line:
            inside = True
        elif _END in line:
            inside = False
        elif inside and (m := re.match(r"\d+\s+(\w+)\(", line)):
            out[m.group(1)] += 1
    return out


def run_side(side: str) -> dict[str, Any]:
    """One side in its own process (under ``strace -f`` where it is installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        res, log = Path(tmp) / "res.json", Path(tmp) / "strace.log"
        cmd = [sys.executable, __file__, "--child", side, "--result", str(res)]
        strace = shutil.which("strace")
        if strace:
            cmd = [strace, "-f", "-qq", "-o", str(log), *cmd]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]),
        }
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        out = json.loads(res.read_text())
        out["syscalls"] = dict(_syscalls(log.read_text())) if strace else None
    return out


def render(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for side, r in results.items():
        n = r["steps"]
        per_gen = ", ".join(
            f"{c} ({t:.1f} ms)" for c, t in zip(r["collections"], r["gc_ms"], strict=True)
        )
        sc = r["syscalls"]
        calls = (
            "strace not installed"
            if sc is None
            else (
                f"{sum(sc.values()) / n:.2f}: "
                + ", ".join(f"{k} {v / n:.2f}" for k, v in Counter(sc).most_common(6))
            )
        )
        full = f"{r['tracked']:,} / {r['full_ms']:.0f} ms"
        rows.append(f"| {side} | {n} | {per_gen} | {full} | {calls} |")
    return [
        "# Garbage collections and system calls per step (issue 46)",
        "",
        f"Command: `python benchmarks/step_gc_syscalls.py`; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"commit {git_in(ROOT, 'rev-parse', '--short', 'HEAD')}; torch threads 1; tiny model of `runtime_overhead.py`, 1 stage, M = 4.",
        "",
        "| side | steps in the window | collections in the window, generation 0, 1, 2 (their time) | after the run: tracked objects / one full collection | system calls per step: all, then by name |",
        "|---|---|---|---|---|",
        *rows,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(child(args.child)))
        return
    write_report(render({side: run_side(side) for side in ("plain", "dapple")}), args.out)


if __name__ == "__main__":
    main()
