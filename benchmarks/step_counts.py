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

``--stages 2`` counts a pipeline instead: two gloo processes (one torch thread each) train the
same model on a straight 2-stage plan under the ``dapple`` schedule (1F1B), ``--m``
micro-batches; each rank counts one step after warm-up, from the start of its ``run_step`` to
the start of the next, and one process counts one step of the plain loop over the same pieces.
What the two ranks make together beyond the plain loop is what the pipeline adds: its messages
(sends, receives and their buffers), the gradient norm and the step's world collective.

Usage::

    python benchmarks/step_counts.py --before-src /tmp/before/src [--out FILE.md]
    python benchmarks/step_counts.py --before-src /tmp/before/src --stages 2 [--m 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _bench_common import git_in, json_child

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


def _pipeline_worker(rank: int, port: int, m: int, out: Any) -> None:
    """One rank of the 2-stage run: its counts of step ``WARMUP`` (``run_step`` to the next)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    import runtime_overhead as ro
    from dapple.core.plan import straight_plan
    from dapple.runtime import run_plan
    from dapple.runtime.interpreter import ProgramInterpreter

    torch.set_num_threads(1)
    size = dict(ro.MODELS["tiny"], M=m)
    wl, _ = ro._model(size)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    win, counted = _op_counter(), {}
    run_step = ProgramInterpreter.run_step

    def counting(self: Any, step: int, inputs: Any, targets: Any) -> Any:
        if step == WARMUP:
            win.start()
        elif step == WARMUP + 1:
            counted.update(_as_dicts(win.stop()))
        return run_step(self, step, inputs, targets)

    ProgramInterpreter.run_step = counting  # type: ignore[method-assign]
    n = wl.num_layers
    plan = straight_plan(n, [0, n // 2], global_batch_size=size["G"], num_micro_batches=m)
    run_plan(plan, wl, ro._config(WARMUP + 3), device=torch.device("cpu"))
    dist.destroy_process_group()
    out.put((rank, counted))


def pipeline_child(m: int) -> dict[str, Any]:
    """Both ranks' counts of a 2-stage step, and one plain step's."""
    import torch
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).parent))
    import runtime_overhead as ro

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_pipeline_worker, args=(r, port, m, q)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    torch.set_num_threads(1)
    size = dict(ro.MODELS["tiny"], M=m)
    wl, _ = ro._model(size)
    step = ro._plain_step(wl.build_model(ro.SEED), wl, size, WARMUP + 2)
    win = _op_counter()
    for k in range(WARMUP + 1):
        if k == WARMUP:
            win.start()
        step(k)
    return {"plain": _as_dicts(win.stop()), "ranks": [ranks[0], ranks[1]]}


def _run_child(src: Path, m: int, stages: int = 1) -> dict[str, Any]:
    result: dict[str, Any] = json_child(
        __file__, src, [str(m), "--stages", str(stages)], f"child {src} M={m}"
    )
    return result


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
        diffs = {v: _extra(by_m[hi], kind) for v, by_m in res.items()}
        lines += _largest(diffs, f"Largest differences per {what} at M = {hi} (dapple - plain):")
    return "\n".join(lines) + "\n"


def _pipeline_report(res: dict[str, dict[str, Any]], args: Any, versions: dict[str, str]) -> str:
    lines = [
        f"Command: `python benchmarks/step_counts.py --before-src {args.before_src} --stages 2 "
        f"--m {args.m}`; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{os.cpu_count()} CPU cores (counts do not depend on the load); versions: "
        + ", ".join(f"{k} = {v}" for k, v in versions.items()),
        "",
        "| version | kind | plain loop | rank 0 (stage 0) | rank 1 (stage 1) | ranks - plain |",
        "|---|---|---|---|---|---|",
    ]
    for v, r in res.items():
        for kind, what in (("ops", "aten ops"), ("calls", "Python calls")):
            p = sum(r["plain"][kind].values())
            per = [sum(x[kind].values()) for x in r["ranks"]]
            lines.append(f"| {v} | {what} | {p} | {per[0]} | {per[1]} | {sum(per) - p:+d} |")
    for kind, what in (("ops", "aten op"), ("calls", "Python call")):
        diffs = {}
        for v, r in res.items():
            both: Counter[str] = Counter()
            for x in r["ranks"]:
                both.update(x[kind])
            diffs[v] = _diff(Counter(r["plain"][kind]), both)
        lines += _largest(diffs, f"Largest differences per {what} (both ranks - plain):")
    return "\n".join(lines) + "\n"


def _largest(diffs: dict[str, dict[str, int]], title: str) -> list[str]:
    """A table of each version's 12 largest differences by name, side by side."""
    lines = ["", title, "", "| " + " | ".join(f"{v}: count | {v}: name" for v in diffs) + " |",
             "|" + "---|---|" * len(diffs)]  # fmt: skip
    cols = [sorted(d.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:12] for d in diffs.values()]
    for i in range(max(len(c) for c in cols)):
        cells = []
        for c in cols:
            cells += [f"{c[i][1]:+d}", f"`{c[i][0]}`"] if i < len(c) else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _diff(plain: Counter[str], dapple: Counter[str]) -> dict[str, int]:
    """Per name: dapple's count minus the plain loop's (names that differ)."""
    return {k: dapple[k] - plain[k] for k in plain.keys() | dapple.keys() if dapple[k] != plain[k]}


def _extra(r: dict[str, Any], kind: str) -> dict[str, int]:
    """Per name: dapple's count minus the plain loop's."""
    return _diff(Counter(r["plain"][kind]), Counter(r["dapple"][kind]))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--before-src", type=Path, default=Path("/tmp/before/src"))
    ap.add_argument("--out", type=Path, default=None, help="write the tables here too")
    ap.add_argument("--load", type=Path, help="the counts of an earlier run (its --out .json)")
    ap.add_argument("--stages", type=int, choices=(1, 2), default=1, help="1 stage or 2 ranks")
    ap.add_argument("--m", type=int, default=4, help="micro-batches M (--stages 2)")
    args = ap.parse_args()
    if args.child:
        counts = child(args.child) if args.stages == 1 else pipeline_child(args.child)
        print(json.dumps(counts))
        return
    srcs = {"before": args.before_src, "after": ROOT / "src"}
    versions = {"before": str(args.before_src),
                "after": f"{git_in(ROOT, 'rev-parse', '--short', 'HEAD')} + working tree"}  # fmt: skip
    if args.stages == 2:
        pipeline = {v: _run_child(s, args.m, 2) for v, s in srcs.items()}
        text = _pipeline_report(pipeline, args, versions)
    else:
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
