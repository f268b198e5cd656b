"""Issue 47's re-run (battery H): every kind of case the issue lists in items 1-7 and 9, and the
file-argument kinds of item 8 (binary, non-UTF-8, empty, nested 200,000 deep, a directory,
missing, unreadable; read-only, under-a-file and missing output folders) for every command and
file argument, each run as a user runs it: ``python -m dapple ...`` in a fresh folder W.

Each case records its exit code, its first ``dapple`` line of stderr, its seconds (and the
seconds after its poke: a signal or SIGSTOP sent while it runs), the processes of the case still
running :data:`_battery.GRACE_S` after it ended (found by an environment tag every child
inherits, and by ``pgrep -f`` of W), and the files under W it changed. It is **BAD** for a
traceback, a run killed at its limit or past its own bound (*unbounded*), a process left
(*orphan*), a file that was there before and is changed or gone without the case writing it
(*lost file*), a refusal that leaves files, a refusal in other than one ``dapple: error:`` line,
an exit code other than 0/2 where one of those is expected, or a failed check of what the run
did (*silent wrong result*). Rows append to a JSON-lines file, so that groups run apart;
``--report`` writes the markdown from it. Run from the repository root::

    python benchmarks/battery_47h.py --only 3,4 --rows /tmp/h.jsonl
    python benchmarks/battery_47h.py --report --rows /tmp/h.jsonl --out benchmarks/battery_47h.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _battery import live_case, processes_left, snapshot
from _battery_47h_cases import GROUPS, H, Poke, setup
from _bench_common import HERE, header

__all__ = ["main", "report", "run_groups"]


def _changes(before: dict[str, str], after: dict[str, str], writes: tuple[str, ...]):
    def ours(p: str) -> bool:
        return any(p == x or p.startswith(x.rstrip("/") + "/") for x in writes)

    lost = sorted(p for p, h in before.items() if after.get(p) != h and not ours(p))
    created = sorted(p for p in after if p not in before)
    return lost, created


def _run(case: H, w: Path, i: int) -> dict[str, Any]:
    argv = [a.replace("{W}", str(w)) for a in case.argv]
    before = snapshot(w)
    tag = f"{case.group}/{i}/{os.getpid()}"
    poke = None
    if case.poke is not None:
        case.poke.at.clear()

        def poke(proc: subprocess.Popen[bytes], t: str, p: Poke = case.poke) -> None:
            p(proc, t, w)

    start = time.monotonic()
    rc, line, took, tb, errors, left, stderr = live_case(
        argv, w, tag, limit_s=case.limit_s, poke=poke, prefix=case.prefix
    )
    left += processes_left(w)
    after_poke = None
    if case.poke is not None and case.poke.at:
        after_poke = took - (case.poke.at[0] - start)
    lost, created = _changes(before, snapshot(w), case.writes)
    flags = []
    if tb:
        flags.append("traceback")
    if rc == 124:
        flags.append(f"unbounded: killed at {case.limit_s:.0f} s")
    elif case.bound_s is not None and after_poke is not None and after_poke > case.bound_s:
        flags.append(f"unbounded: {after_poke:.0f} s after the poke, bound {case.bound_s:.0f}")
    if left:
        flags.append(f"orphan: {left} processes left")
    if lost:
        flags.append(f"lost file: {', '.join(lost[:3])}")
    if case.expect == "refuse" and rc == 2 and created:
        flags.append(f"refusal left {', '.join(created[:3])}")
    if case.expect == "refuse" and rc == 2 and errors != 1:
        flags.append(f"{errors} error lines")
    if case.expect in ("ok", "refuse") and rc not in (0, 2, 124):
        flags.append(f"rc {rc}")
    if case.check is not None and rc != 124:
        why = case.check(w, line)
        if why:
            flags.append(f"silent: {why}")
    if flags:
        said = "**BAD** (" + "; ".join(flags) + ")"
    elif (case.expect == "ok" and rc != 0) or (case.expect == "refuse" and rc != 2):
        said = f"differs (expected {case.expect})"
    else:
        said = "as expected"
    shown = " ".join(argv).replace(str(w), "W")
    return {"group": case.group, "argv": shown, "rc": rc, "line": line.replace(str(w), "W"),
            "s": round(took, 1), "after_poke": None if after_poke is None else round(after_poke, 1),
            "left": left, "lost": lost, "created": created[:5], "verdict": said,
            "errors": errors, "stderr_tail": stderr[-800:].replace(str(w), "W")}  # fmt: skip


def run_groups(only: list[str], rows: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="battery_47h-") as tmp:
        w = Path(tmp)
        try:
            for g in only:
                setup(g, w)
                for i, case in enumerate(GROUPS[g](w)):
                    row = _run(case, w, i)
                    with rows.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"{row['rc']:>4} {row['s']:6.1f}s {row['argv'][:100]} | "
                          f"{row['line'][:110]} | {row['verdict']}", flush=True)  # fmt: skip
        finally:
            for d in w.rglob("*"):
                if d.is_dir() and not d.is_symlink():
                    d.chmod(0o755)


COUNTS = ("traceback", "orphan", "unbounded", "lost file", "silent")


def report(rows_path: Path, out: Path, command: str) -> None:
    rows = [json.loads(x) for x in rows_path.read_text().splitlines() if x.strip()]
    counts = {k: sum(k in r["verdict"] for r in rows) for k in COUNTS}
    bad = sum(r["verdict"].startswith("**BAD") for r in rows)
    differs = sum(r["verdict"].startswith("differs") for r in rows)
    lines = header("Issue 47 battery H: the re-run of every kind of case", command)
    lines += ["", f"{len(rows)} cases; {bad} BAD; {differs} outcomes other than expected. "
              "Counts of BAD cases by kind: " + ", ".join(f"{k} {n}" for k, n in counts.items())
              + ". W is the run's temporary folder.", "",
              "| # | group | command (`dapple ...`) | rc | first line of stderr | s | s after poke "
              "| verdict |", "|---:|---|---|---:|---|---:|---:|---|"]  # fmt: skip
    for i, r in enumerate(rows, 1):
        cell = r["line"].replace("|", "\\|")
        poke = "" if r["after_poke"] is None else f"{r['after_poke']:.1f}"
        argv = r["argv"].replace("|", "\\|")
        lines.append(f"| {i} | {r['group']} | `{argv}` | {r['rc']} | {cell} | {r['s']:.1f} "
                     f"| {poke} | {r['verdict']} |")  # fmt: skip
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups")
    ap.add_argument("--rows", default="/tmp/battery_47h.jsonl", help="JSON-lines rows file")
    ap.add_argument("--report", action="store_true", help="write --out from --rows and stop")
    ap.add_argument("--out", default=str(HERE / "battery_47h.md"))
    args = ap.parse_args()
    if args.report:
        report(Path(args.rows), Path(args.out), " ".join(["python", *sys.argv]))
        return
    unknown = [g for g in args.only.split(",") if g not in GROUPS]
    if unknown:
        sys.exit(f"unknown groups {unknown}; groups: {', '.join(GROUPS)}")
    run_groups(args.only.split(","), Path(args.rows))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
