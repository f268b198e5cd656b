"""Where ``dapple plan`` of a small MoE profile spends its time (issue 47, battery F rows 33-34).

The analytic Mixtral of ``benchmarks/battery_47f.py`` (6 layers: embedding, 4 blocks of 8
experts, head) planned on ``examples/mixed.json`` (8 H100 + 8 A100-40GB) for a global batch of
64, as ``dapple plan`` runs it. Each DAPPLE search of one tensor width
(``dapple.planner.search._search_width``) is timed in CPU seconds, with the scorer it searched
with (``ExpertScorer``: expert widths e_s offered) and whether it reported progress; the rest
(the refinement, the other offers, the CLI) is the total less their sum.

Usage: ``python benchmarks/moe_plan_time.py [--out benchmarks/moe_plan_time.md]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench_common import header
from battery_47f import _MIX

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "examples" / "mixed.json"


def _profile(work: Path) -> Path:
    """The analytic MoE profile of ``_MIX`` on an H100 (written by ``dapple profile``)."""
    (work / "mix").mkdir()
    (work / "mix" / "config.json").write_text(json.dumps(_MIX))
    out = work / "moe.json"
    subprocess.run([sys.executable, "-m", "dapple", "profile", "--analytic", "h100", "-m",
                    f"hf:{work / 'mix'}", "-o", str(out)], check=True, capture_output=True)  # fmt: skip
    return out


def measure(profile: Path) -> tuple[list[tuple[int, str, bool, float]], float, str]:
    """``([(tensor width, scorer, reported progress, CPU s)], total CPU s, plan's last line)``."""
    import dapple.planner.search as search
    from dapple.cli import main

    rows: list[tuple[int, str, bool, float]] = []
    original = search._search_width

    def timed(sc: Any, *args: Any) -> None:
        t0 = time.process_time()
        original(sc, *args)
        rows.append((sc.tensor_width, type(sc).__name__, args[-1] is not None,
                     time.process_time() - t0))  # fmt: skip

    search._search_width = timed  # type: ignore[assignment]
    out = io.StringIO()
    t0 = time.process_time()
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["plan", "--profile", str(profile), "--cluster", str(CLUSTER),
                       "--global-batch-size", "64"])  # fmt: skip
    finally:
        search._search_width = original
    total = time.process_time() - t0
    if rc != 0:
        raise SystemExit(f"dapple plan exited {rc}")
    said = [x for x in out.getvalue().splitlines() if x.startswith("predicted step L")]
    return rows, total, said[-1] if said else ""


def _load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the markdown here")
    args = ap.parse_args()
    cmd = "python benchmarks/moe_plan_time.py" + (f" --out {args.out}" if args.out else "")
    lines = header(
        "dapple plan of a 6-layer MoE profile on a mixed cluster: where the time goes", cmd
    )
    with tempfile.TemporaryDirectory() as tmp:
        rows, total, said = measure(_profile(Path(tmp)))
    lines.insert(-1, f"- load average {_load()} at the end")
    lines += [
        "`dapple plan --profile <analytic Mixtral, 6 layers> --cluster examples/mixed.json "
        "--global-batch-size 64`, in process; CPU seconds of each tensor width's DAPPLE search.",
        "",
        "| pass | tensor width t | scorer | progress reported | CPU s |",
        "|---:|---:|---|---|---:|",
    ]
    per_pass = len(rows) // 2 or len(rows)
    for i, (t, scorer, progress, s) in enumerate(rows):
        lines.append(f"| {i // per_pass + 1} | {t} | {scorer} | {'yes' if progress else 'no'} "
                     f"| {s:.1f} |")  # fmt: skip
    searched = sum(r[3] for r in rows)
    silent = sum(r[3] for r in rows if not r[2])
    lines += [
        "",
        f"- total {total:.1f} CPU s: the searches {searched:.1f}, of which {silent:.1f} reported "
        f"no progress; the rest (refinement, other offers, CLI) {total - searched:.1f}",
        f"- plan: {said}",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
