"""Where the aten ops a dapple step runs beyond a plain loop come from (issue 46).

One process per version runs, on CPU, the tiny model of ``runtime_overhead.py`` (traced pieces,
1 stage, fp32, fused AdamW, metrics and the non-finite guard on, no clipping, ``--m``
micro-batches) two ways, and records one step of each after warm-up with ``torch.profiler``
(``with_stack``): the plain loop over the same pieces (``runtime_overhead._plain_step``) and
:func:`dapple.runtime.run_plan` of a 1-stage plan (one step from the end of the previous
step's ``on_step`` to the end of its own).

Every ``aten::`` event (nested ones included) is attributed to its *top-level* aten op (the
outermost aten op above it) and to the innermost Python function of dapple (or of the
benchmark) that called it. Per top-level op, dapple's count minus the plain loop's is what
dapple adds; the table lists each such op with the dapple functions its events came from.

Usage::

    git archive <commit> src | tar -x -C /tmp/before
    python benchmarks/step_sites.py --before-src /tmp/before/src [--m 4] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from _bench_common import git_in, json_child

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3
_OWN = re.compile(r".*?/(dapple/|benchmarks/)")


def _site(event: Any) -> tuple[str, str]:
    """``(innermost dapple or benchmark function, top-level aten op)`` of a profiler event."""
    top, parent = event.name, event.cpu_parent
    while parent is not None:
        name = parent.name
        if name.startswith("aten::"):
            top = name
        elif "dapple/" in name or "benchmarks/" in name:
            return _OWN.sub("", name), top
        parent = parent.cpu_parent
    return "?", top


def _counts(prof: Any) -> dict[str, dict[str, int]]:
    """Top-level aten op -> {site: aten events under it}."""
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for e in prof.events():
        if e.name.startswith("aten::"):
            site, top = _site(e)
            out[top][site] += 1
    return {top: dict(c) for top, c in out.items()}


def child(m: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    import runtime_overhead as ro

    torch.set_num_threads(1)
    size = dict(ro.MODELS["tiny"], M=m)
    wl, _ = ro._model(size)

    def profile() -> Any:
        cpu = [torch.profiler.ProfilerActivity.CPU]
        return torch.profiler.profile(activities=cpu, with_stack=True)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    out: dict[str, Any] = {}
    try:
        step = ro._plain_step(wl.build_model(ro.SEED), wl, size, WARMUP + 2)
        for k in range(WARMUP):
            step(k)
        with profile() as prof:
            step(WARMUP)
        out["plain"] = _counts(prof)
        held: dict[str, Any] = {}

        def on_step(metrics: Any) -> None:
            if metrics.step == WARMUP - 1:
                held["prof"] = profile()
                held["prof"].__enter__()
            elif metrics.step == WARMUP:
                held["prof"].__exit__(None, None, None)
                out["dapple"] = _counts(held["prof"])

        ro._dapple(wl, size, WARMUP + 2, on_step)
    finally:
        dist.destroy_process_group()
    return out


def _run_child(src: Path, m: int) -> dict[str, Any]:
    counts: dict[str, Any] = json_child(__file__, src, [str(m)], f"child {src} M={m}")
    return counts


def _rows(r: dict[str, Any]) -> list[tuple[str, int, int, str]]:
    """Per top-level op that dapple runs more or less often: (op, dapple - plain, plain,
    dapple's sites), largest difference first."""
    rows = []
    for top in r["plain"].keys() | r["dapple"].keys():
        d, p = r["dapple"].get(top, {}), r["plain"].get(top, {})
        extra = sum(d.values()) - sum(p.values())
        if extra:
            sites = ", ".join(f"`{s}` {n}" for s, n in sorted(d.items(), key=lambda kv: -kv[1]))
            rows.append((top, extra, sum(p.values()), sites))
    return sorted(rows, key=lambda row: (-row[1], row[0]))


def _report(res: dict[str, dict[str, Any]], args: Any, versions: dict[str, str]) -> str:
    lines = [
        f"Command: `python benchmarks/step_sites.py --before-src {args.before_src} --m "
        f"{args.m}`; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{os.cpu_count()} CPU cores (counts do not depend on the load); versions: "
        + ", ".join(f"{k} = {v}" for k, v in versions.items()),
    ]
    for v, r in res.items():
        total = {k: sum(sum(c.values()) for c in r[k].values()) for k in ("plain", "dapple")}
        lines += [
            "",
            f"**{v}**: plain loop {total['plain']} aten events, dapple {total['dapple']} "
            f"(+{total['dapple'] - total['plain']}), M = {args.m}.",
            "",
            "| top-level op | dapple - plain | plain | dapple's events under it, by function |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{t}` | {e:+d} | {p} | {s} |" for t, e, p, s in _rows(r)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--before-src", type=Path, default=Path("/tmp/before/src"))
    ap.add_argument("--m", type=int, default=4, help="micro-batches M")
    ap.add_argument("--out", type=Path, default=None, help="write the tables here too")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    srcs = {"before": args.before_src, "after": ROOT / "src"}
    versions = {"before": str(args.before_src),
                "after": f"{git_in(ROOT, 'rev-parse', '--short', 'HEAD')} + working tree"}  # fmt: skip
    text = _report({v: _run_child(s, args.m) for v, s in srcs.items()}, args, versions)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
