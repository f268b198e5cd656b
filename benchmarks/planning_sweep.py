"""Issue 48's planning-time sweep: Llama-3 8B, 70B and 405B on 64 to 16,384 H100s.

For each profile and cluster size (``h100-8x``: servers of 8 H100) runs
:mod:`planning_scale` in a fresh process three times: DAPPLE's search as ``dapple plan
--zero-stage auto --tensor-widths auto`` runs it, with and without ``--interleave``, and the
grid planner (``dapple plan --planner grid``). Each run's CPU seconds (user + sys of the search,
``time.process_time`` in that process) and wall seconds are printed as one JSON line per run
(also appended to ``--jsonl``), then a markdown table: per case the CPU and wall seconds of each
search and the predicted step L of each plan (with ``--simulate`` also its simulated step, and
the ratio of the search's plan of least L to the grid's, simulated).

    dapple profile --analytic h100 -m llama3-8b --precision bf16 -o p8b.json
    dapple profile --analytic h100 -m llama3-70b --precision bf16 --recompute full -o p70b.json
    dapple profile --analytic h100 -m llama3.1-405b --precision fp8 --recompute full -o p405.json
    python benchmarks/planning_sweep.py 8B=p8b.json 70B=p70b.json 405B=p405.json \\
        --servers 8 64 512 2048 --jsonl sweep.jsonl

Runs go smallest cluster first, so a sweep cut short by ``--budget-s`` (wall seconds; the runs
not started are listed as not run) still covers the small sizes. ``--from-jsonl`` prints the
table of runs recorded before, without running anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNS = (("dapple", ["--interleave"]), ("dapple", []), ("grid", []))
"""(planner, flags) of each case's runs: the search with and without interleaving, the grid."""


def run_one(
    profile: str, servers: int, planner: str, interleave: bool, batch: int, sim: bool = False
) -> dict[str, Any]:
    """One :mod:`planning_scale` run in a fresh process: its JSON line, or its error."""
    cmd = [sys.executable, str(HERE / "planning_scale.py"), profile, "--servers", str(servers),
           "--global-batch-size", str(batch), "--planner", planner]  # fmt: skip
    if planner == "dapple" and not interleave:
        cmd.append("--no-interleave")
    if sim:
        cmd.append("--simulate")
    got = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if got.returncode != 0:
        lines = (got.stderr or got.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {got.returncode}"}
    out: dict[str, Any] = json.loads(got.stdout.strip().splitlines()[-1])
    return out


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of recorded runs: one line per (model, devices)."""
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["model"], r["servers"]), {})[r["run"]] = r
    out = [
        "| model | H100 | search CPU s (interleave) | wall s | L (ms) | search CPU s (1F1B) "
        "| wall s | L (ms) | grid CPU s | grid L (ms) | L / grid L | simulated / grid's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (model, servers), runs in sorted(by.items(), key=lambda x: (x[0][1], x[0][0])):
        cells = []
        for name in ("interleave", "1f1b"):
            r = runs.get(name)
            cells += _cells(r, with_wall=True)
        g = runs.get("grid")
        cells += _cells(g, with_wall=False)
        ours = [runs[n] for n in ("interleave", "1f1b") if _ok(runs.get(n))]
        best = min(ours, key=lambda r: float(r["L"]), default=None)
        ratio = f"{best['L'] / g['L']:.3f}" if best is not None and _ok(g) else "-"
        sim = "-"
        if best is not None and g is not None and "simulated_ms" in best and "simulated_ms" in g:
            sim = f"{best['simulated_ms'] / g['simulated_ms']:.3f}"
        out.append(f"| {model} | {servers * 8:,} | " + " | ".join(cells) + f" | {ratio} | {sim} |")
    return out


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and "L" in r


def _cells(r: dict[str, Any] | None, with_wall: bool) -> list[str]:
    """CPU s, (wall s,) L of a run; 'not run' or its error otherwise."""
    n = 3 if with_wall else 2
    if r is None:
        return ["not run"] + ["-"] * (n - 1)
    if "L" not in r:
        err = r.get("error", "failed")
        return ["no plan fits" if "InfeasibleError" in err else err[:60]] + ["-"] * (n - 1)
    L = f"{r['L']:,.1f} (M={r['M']}{', interleaved' if r['schedule'] != 'dapple' else ''})"
    if "simulated_ms" in r:
        L += f", simulated {r['simulated_ms']:,.1f}"
    return [f"{r['cpu_s']:.2f}", f"{r['wall_s']:.1f}", L] if with_wall else [f"{r['cpu_s']:.2f}", L]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("profiles", nargs="*", help="NAME=profile.json (dapple profile --analytic)")
    ap.add_argument("--servers", nargs="+", type=int, default=[8, 64, 512, 2048])
    ap.add_argument("--global-batch-size", type=int, default=256)
    ap.add_argument("--jsonl", type=Path, help="append each run's JSON line here")
    ap.add_argument("--budget-s", type=float, default=None, help="start no run after this")
    ap.add_argument("--from-jsonl", type=Path, help="print the table of these runs only")
    ap.add_argument("--simulate", action="store_true", help="also each plan's simulated step")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    if args.from_jsonl:
        rows = [json.loads(x) for x in args.from_jsonl.read_text().splitlines() if x.strip()]
        print("\n".join(table(rows)))
        return
    named = [p.split("=", 1) for p in args.profiles]
    t0 = time.perf_counter()
    for servers in args.servers:
        for model, path in named:
            for planner, flags in RUNS:
                name = "grid" if planner == "grid" else ("interleave" if flags else "1f1b")
                row: dict[str, Any] = {"model": model, "servers": servers, "run": name}
                if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
                    row["error"] = "not run (budget)"
                else:
                    row |= run_one(
                        path, servers, planner, bool(flags), args.global_batch_size, args.simulate
                    )
                    row.pop("stages", None)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.jsonl:
                    with args.jsonl.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
