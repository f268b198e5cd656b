"""What a 2-stage dapple step does beyond a plain loop, counted on each rank (issue 46).

Counts, not times: a loaded machine does not move them. Two gloo processes (CPU, one torch
thread each) train the tiny model of ``runtime_overhead.py`` (traced pieces, fp32, fused
AdamW, metrics and the non-finite guard on) on a straight 2-stage plan under the ``dapple``
schedule (1F1B), M micro-batches; each rank counts one step after warm-up, from the start of
its ``run_step`` to the start of the next (``torch.profiler``'s ``aten::`` events, nested ones
included, and ``cProfile``'s calls: :class:`dapple.profiler.op_counts.OpCounter`). Then one
process counts one step of the plain loop over the same pieces (``runtime_overhead``'s). What
the two ranks make together beyond the plain loop is what the pipeline adds: its messages
(``isend``/``irecv`` and their buffers), the gradient norm and the step's world collective.

Two versions: ``after`` (this checkout's ``src``) and ``before`` (``--before-src``).

Usage::

    python benchmarks/step_counts_pipeline.py --before-src /tmp/before/src [--m 4] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3


def _counter() -> Any:
    """This checkout's :class:`~dapple.profiler.op_counts.OpCounter`, loaded by path (the
    version measured may predate it)."""
    import importlib.util

    path = ROOT / "src" / "dapple" / "profiler" / "op_counts.py"
    spec = importlib.util.spec_from_file_location("_op_counts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.OpCounter()


def _worker(rank: int, port: int, m: int, out: Any) -> None:
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
    win, counted = _counter(), {}
    run_step = ProgramInterpreter.run_step

    def counting(self: Any, step: int, inputs: Any, targets: Any) -> Any:
        if step == WARMUP:
            win.start()
        elif step == WARMUP + 1:
            c = win.stop()
            counted.update(ops=dict(c.ops), calls=dict(c.calls))
        return run_step(self, step, inputs, targets)

    ProgramInterpreter.run_step = counting  # type: ignore[method-assign]
    n = wl.num_layers
    plan = straight_plan(n, [0, n // 2], global_batch_size=size["G"], num_micro_batches=m)
    run_plan(plan, wl, ro._config(WARMUP + 3), device=torch.device("cpu"))
    dist.destroy_process_group()
    out.put((rank, counted))


def _plain(m: int) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import runtime_overhead as ro

    torch.set_num_threads(1)
    size = dict(ro.MODELS["tiny"], M=m)
    wl, _ = ro._model(size)
    step = ro._plain_step(wl.build_model(ro.SEED), wl, size, WARMUP + 2)
    win = _counter()
    for k in range(WARMUP + 1):
        if k == WARMUP:
            win.start()
        step(k)
    c = win.stop()
    return {"ops": dict(c.ops), "calls": dict(c.calls)}


def child(m: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, m, q)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return {"plain": _plain(m), "ranks": [ranks[0], ranks[1]]}


def _run_child(src: Path, m: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, __file__, "--child", str(m)], env=env,
                         capture_output=True, text=True, check=False)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"child {src} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _report(res: dict[str, dict[str, Any]], args: Any) -> str:
    lines = [
        f"Command: `python benchmarks/step_counts_pipeline.py --before-src {args.before_src} "
        f"--m {args.m}`; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{os.cpu_count()} CPU cores (counts do not depend on the load); versions: before = "
        f"{args.before_src}, after = {ROOT / 'src'}",
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
        lines += ["", f"Largest differences per {what} (both ranks - plain):", "",
                  "| " + " | ".join(f"{v}: count | {v}: name" for v in res) + " |",
                  "|" + "---|---|" * len(res)]  # fmt: skip
        cols = []
        for r in res.values():
            both: Counter[str] = Counter()
            for x in r["ranks"]:
                both.update(x[kind])
            p = Counter(r["plain"][kind])
            diff = {k: both[k] - p[k] for k in both.keys() | p.keys() if both[k] != p[k]}
            cols.append(sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:12])
        for i in range(max(len(c) for c in cols)):
            cells = []
            for c in cols:
                cells += [f"{c[i][1]:+d}", f"`{c[i][0]}`"] if i < len(c) else ["", ""]
            lines.append("| " + " | ".join(cells) + " |")
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
    res = {v: _run_child(s, args.m) for v, s in (("before", args.before_src),
                                                  ("after", ROOT / "src"))}  # fmt: skip
    text = _report(res, args)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
