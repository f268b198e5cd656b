"""What dapple does per step beyond a plain loop, counted (issue 46): aten ops and Python calls.

Counts do not depend on the machine's load, unlike the timings of ``runtime_overhead.py``.
One process per (version, M) runs, on CPU, the tiny model of ``runtime_overhead.py`` (traced
pieces, 1 stage, fp32, fused AdamW, metrics and the non-finite guard on, no clipping) two ways,
and counts one step of each after warm-up:

- ``plain``: the plain loop over the same traced pieces (``runtime_overhead._plain_ms``);
- ``dapple``: :func:`dapple.runtime.run_plan` of a 1-stage plan, one step from the end of the
  previous step's ``on_step`` to the end of its own (so batch, interpreter, collective,
  optimizer, metrics line: the whole step).

Counted: ``torch.profiler`` events whose name starts with ``aten::`` (nested ones included:
the ops a step dispatches), and ``cProfile``'s calls (Python functions and builtins). Running
M = 2 and M = 4 separates what dapple adds per micro-batch, ``(extra(4) - extra(2)) / 2``,
from what it adds once per step. Two versions: ``after`` (this checkout's ``src``) and
``before`` (``--before-src``, e.g. ``git archive <commit> src | tar -x -C /tmp/before``).

Usage::

    python benchmarks/step_counts.py --before-src /tmp/before/src [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3
MS = (2, 4)


def _op_counter() -> Any:
    """This checkout's :class:`dapple.profiler.op_counts.OpCounter`, loaded by file path: the
    child's ``dapple`` is the version measured (``--before-src`` may predate the module)."""
    import importlib.util

    path = ROOT / "src" / "dapple" / "profiler" / "op_counts.py"
    spec = importlib.util.spec_from_file_location("_op_counts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module of their class
    spec.loader.exec_module(module)
    return module.OpCounter()


def _as_dicts(counts: Any) -> dict[str, Any]:
    return {"calls": dict(counts.calls), "ops": dict(counts.ops)}


def child(m: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    import runtime_overhead as ro
    from dapple.runtime.optim import make_optimizer

    torch.set_num_threads(1)
    size = dict(ro.MODELS["tiny"], M=m)
    wl, _ = ro._model(size)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out: dict[str, Any] = {}
    try:
        model = wl.build_model(ro.SEED)
        G, b = size["G"], size["G"] // m
        params = list(model.parameters())
        opt = make_optimizer(ro._config(WARMUP + 1), params)
        win = _op_counter()
        for step in range(WARMUP + 1):  # the plain loop of runtime_overhead._plain_ms
            if step == WARMUP:
                win.start()
            x, y = wl.make_batch(G, ro.SEED + step)
            for p in params:
                p.grad = None
            total = 0.0
            for k in range(m):
                loss = wl.loss_fn(model(x[k * b : (k + 1) * b]), y[k * b : (k + 1) * b]) * (b / G)
                loss.backward()
                total = total + loss.detach()
            opt.step()
            float(total)
            if step == WARMUP:
                out["plain"] = _as_dicts(win.stop())
        dwin = _op_counter()

        def on_step(metrics: Any) -> None:
            if metrics.step == WARMUP - 1:
                dwin.start()
            elif metrics.step == WARMUP:
                out["dapple"] = _as_dicts(dwin.stop())

        ro._dapple(wl, size, WARMUP + 2, on_step)
    finally:
        dist.destroy_process_group()
    return out


def _run_child(src: Path, m: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--child", str(m)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"child {src} M={m} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _total(d: dict[str, int]) -> int:
    return sum(d.values())


def _report(res: dict[str, dict[int, dict[str, Any]]], args: Any, versions: dict[str, str]) -> str:
    lines = [
        "Command: `python benchmarks/step_counts.py --before-src "
        f"{args.before_src}`; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"machine: {os.cpu_count()} CPU cores, torch {_torch_version()}; versions: "
        + ", ".join(f"{k} = {v}" for k, v in versions.items()),
        "",
        "| version | M | aten ops: plain | dapple | dapple - plain | Python calls: plain | "
        "dapple | dapple - plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    extra: dict[tuple[str, str, int], int] = {}
    for v, by_m in res.items():
        for m, r in by_m.items():
            row = [v, str(m)]
            for kind in ("ops", "calls"):
                p, d = _total(r["plain"][kind]), _total(r["dapple"][kind])
                extra[v, kind, m] = d - p
                row += [str(p), str(d), f"+{d - p}"]
            lines.append("| " + " | ".join(row) + " |")
    lo, hi = MS
    lines += ["", f"Split (from M = {lo} and {hi}): what dapple adds per micro-batch and once "
              "per step.", "", "| version | aten ops per micro-batch | aten ops per step "
              "(fixed) | Python calls per micro-batch | Python calls per step (fixed) |",
              "|---|---|---|---|---|"]  # fmt: skip
    for v in res:
        cells = []
        for kind in ("ops", "calls"):
            per_mb = (extra[v, kind, hi] - extra[v, kind, lo]) / (hi - lo)
            cells += [f"{per_mb:+g}", f"{extra[v, kind, lo] - lo * per_mb:+g}"]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines += ["", "What dapple adds per micro-batch, by aten op (``(extra(4) - extra(2)) / 2``):",
              "", "| " + " | ".join(f"{v}: per micro-batch | {v}: op" for v in res) + " |",
              "|" + "---|---|" * len(res)]  # fmt: skip
    cols = []
    for by_m in res.values():
        ex = {m: _extra(by_m[m], "ops") for m in (lo, hi)}
        per = {k: (ex[hi].get(k, 0) - ex[lo].get(k, 0)) / (hi - lo) for k in ex[hi].keys() | ex[lo]}
        cols.append(sorted(((k, n) for k, n in per.items() if n), key=lambda kv: (-kv[1], kv[0])))
    for i in range(max(len(c) for c in cols)):
        cells = []
        for c in cols:
            cells += [f"{c[i][1]:+g}", f"`{c[i][0]}`"] if i < len(c) else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    for kind, what in (("ops", "aten op"), ("calls", "Python call")):
        lines += ["", f"Largest differences per {what} at M = {hi} (dapple - plain):", "",
                  "| " + " | ".join(f"{v}: count | {v}: name" for v in res) + " |",
                  "|" + "---|---|" * len(res)]  # fmt: skip
        cols = []
        for by_m in res.values():
            diff = _extra(by_m[hi], kind)
            cols.append(sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:12])
        for i in range(max(len(c) for c in cols)):
            cells = []
            for c in cols:
                cells += [f"{c[i][1]:+d}", f"`{c[i][0]}`"] if i < len(c) else ["", ""]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _extra(r: dict[str, Any], kind: str) -> dict[str, int]:
    """Per name: dapple's count minus the plain loop's."""
    p, d = Counter(r["plain"][kind]), Counter(r["dapple"][kind])
    return {k: d[k] - p[k] for k in p.keys() | d.keys() if d[k] != p[k]}


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _git(src: Path, *a: str) -> str:
    return subprocess.run(["git", "-C", str(src), *a], capture_output=True, text=True,
                          check=False).stdout.strip()  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--before-src", type=Path, default=Path("/tmp/before/src"))
    ap.add_argument("--out", type=Path, default=None, help="write the tables here too")
    ap.add_argument("--load", type=Path, help="the counts of an earlier run (its --out .json)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    srcs = {"before": args.before_src, "after": ROOT / "src"}
    versions = {"before": str(args.before_src),
                "after": f"{_git(ROOT, 'rev-parse', '--short', 'HEAD')} + working tree"}  # fmt: skip
    if args.load is not None:
        raw = json.loads(args.load.read_text())
        res = {v: {int(m): r for m, r in by_m.items()} for v, by_m in raw.items()}
    else:
        res = {v: {m: _run_child(s, m) for m in MS} for v, s in srcs.items()}
        if args.out is not None:
            args.out.with_suffix(".json").write_text(json.dumps(res))
    text = _report(res, args, versions)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
