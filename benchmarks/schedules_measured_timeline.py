"""Per-rank action timelines of dapple's and torch's V schedules on the same straight partition
(CPU, gloo): where each rank computes, waits for a message, and idles, step by step.

A diagnostic beside ``schedules_measured_v.py``: the same model, chunks and worker group, with
every compute action (F, I, W, B) and every wait on a message timed on each rank
(``time.perf_counter``, one clock for all processes of the machine). dapple: the stage
executors' ``forward/backward/backward_input/backward_weight`` and their receive waits
(``StageLinks.wait_concat``), the step's sends (``finish_sends``) and its collective; torch: the stages'
``forward_one_chunk/backward_one_chunk/backward_weight_one_chunk`` and the schedule's
``_wait_batch_p2p``. Per rank and step: the span, the wall time in each compute kind, in message
waits and outside both, and each action's start relative to the step's start on rank 0.

Usage: ``python benchmarks/schedules_measured_timeline.py --ranks 4 --schedule zbv
[--rounds 3 --steps 4] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import bench_transformer, join_worker_group, load_note, run_worker_group
from _schedules_worker import TorchPipe
from dapple.core.plan import Plan
from schedules_measured_v import build_cases
from vs_torch_pipelining import LR


class Recorder:
    """Timed events of this process: ``(step, kind, stage, micro-batch, t0, t1)`` with the
    kinds F/I/W/B (compute, their receive waits excluded), ``wait`` (a message wait inside an
    action), ``sends`` (the step's send completions), ``meet`` (dapple's step collective) and
    ``step`` (the whole step)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str, int, int, float, float]] = []
        self.step = -1
        self.waited = 0.0

    def add(self, kind: str, stage: int, m: int, t0: float, t1: float) -> None:
        self.events.append((self.step, kind, stage, m, t0, t1))

    def compute(self, fn: Callable[..., Any], kind: str, stage_of: Callable[..., int]) -> Any:
        """``fn`` wrapped: its span recorded as ``kind`` minus the waits inside it."""

        def wrapper(obj: Any, a: Any, *args: Any, **kw: Any) -> Any:
            before, t0 = self.waited, time.perf_counter()
            try:
                return fn(obj, a, *args, **kw)
            finally:
                t1 = time.perf_counter()
                w = self.waited - before
                m = a if isinstance(a, int) else getattr(a, "micro_batch", -1)
                self.add(kind, stage_of(obj, a), m, t0 + w, t1)

        return wrapper

    def wait(self, fn: Callable[..., Any], kind: str = "wait") -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                t1 = time.perf_counter()
                self.waited += t1 - t0
                self.add(kind, -1, -1, t0, t1)

        return wrapper


def install(rec: Recorder) -> None:
    """Wrap dapple's and torch's compute and wait functions in this process."""
    import torch.distributed.pipelining.schedules as tsched
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from dapple.runtime.interpreter import ProgramInterpreter
    from dapple.runtime.stage import StageExecutor
    from dapple.runtime.stage_links import StageLinks

    d_stage = lambda ex, a: a.stage  # noqa: E731
    for name, k in (("forward", "F"), ("backward", "B"), ("backward_input", "I"),
                    ("backward_weight", "W")):  # fmt: skip
        setattr(StageExecutor, name, rec.compute(getattr(StageExecutor, name), k, d_stage))
    StageLinks.wait_concat = rec.wait(StageLinks.wait_concat)
    StageExecutor.finish_sends = rec.wait(StageExecutor.finish_sends, "sends")
    ProgramInterpreter._meet = rec.wait(ProgramInterpreter._meet, "meet")
    for name, k in (("_prepare_update", "prep"), ("_apply_update", "opt")):
        setattr(ProgramInterpreter, name, rec.wait(getattr(ProgramInterpreter, name), k))
    run_step = ProgramInterpreter.run_step

    def stepped(interp: Any, step: int, *a: Any, **kw: Any) -> Any:
        rec.step = step
        t0 = time.perf_counter()
        try:
            return run_step(interp, step, *a, **kw)
        finally:
            rec.add("step", -1, -1, t0, time.perf_counter())

    ProgramInterpreter.run_step = stepped
    t_stage = lambda st, m: st.stage_index  # noqa: E731
    _PipelineStageBase.forward_one_chunk = rec.compute(
        _PipelineStageBase.forward_one_chunk, "F", t_stage
    )
    bwd = _PipelineStageBase.backward_one_chunk

    def backward_one_chunk(st: Any, m: int, *a: Any, **kw: Any) -> Any:
        full = kw.get("full_backward", a[1] if len(a) > 1 else True)
        return rec.compute(bwd, "B" if full else "I", t_stage)(st, m, *a, **kw)

    _PipelineStageBase.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]
    _PipelineStageBase.backward_weight_one_chunk = rec.compute(
        _PipelineStageBase.backward_weight_one_chunk, "W", t_stage
    )
    tsched._wait_batch_p2p = rec.wait(tsched._wait_batch_p2p)


def worker(
    rank: int, world: int, port: int, cases: list[dict[str, Any]], opts: dict[str, Any], out: str
) -> None:
    import torch
    import torch.distributed as dist

    from dapple.runtime import TrainConfig, run_plan, shutdown_distributed

    join_worker_group(rank, world, port)
    wl = bench_transformer(layers=opts["blocks"])
    rec = Recorder()
    install(rec)
    runs: list[dict[str, Any]] = []
    peer: TorchPipe | None = None
    for rnd in range(opts["rounds"]):
        for c in cases if rnd % 2 == 0 else cases[::-1]:
            rec.events = []
            dist.barrier()
            if c["runner"] == "dapple":
                cfg = TrainConfig(
                    steps=opts["steps"], seed=rnd, optimizer="sgd", lr=LR, device="cpu"
                )
                run_plan(Plan.from_dict(c["plan"]), wl, cfg, device=torch.device("cpu"))
            else:
                if peer is None:
                    peer = TorchPipe(c["kind"], rank, opts["G"], opts["M"], c["chunks"],
                                     c["placement"], opts["blocks"])  # fmt: skip
                for k in range(opts["steps"]):
                    rec.step = k
                    t0 = time.perf_counter()
                    peer.step(rnd * opts["steps"] + k)
                    rec.add("step", -1, -1, t0, time.perf_counter())
            got: list[Any] = [None] * world
            dist.all_gather_object(got, rec.events)
            if rank == 0:
                runs.append({"label": c["label"], "round": rnd, "events": got})
                print(f"  round {rnd} {c['label']} ({load_note()})", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"runs": runs}))
    peer = None
    shutdown_distributed()


# -- analysis -----------------------------------------------------------------------------------
def summarize(run: dict[str, Any], skip: int) -> dict[str, Any]:
    """Per rank, medians over the steps after ``skip``: the step span and the wall ms in each
    compute kind, in message waits, in the step's sends and collective, and the rest."""
    per_rank = []
    for events in run["events"]:
        steps = sorted({e[0] for e in events if e[1] == "step" and e[0] >= skip})
        rows = []
        for s in steps:
            ev = [e for e in events if e[0] == s]
            span = next((e[5] - e[4]) for e in ev if e[1] == "step") * 1e3
            row = {"span": span}
            for k in ("F", "I", "W", "B", "wait", "sends", "meet"):
                row[k] = sum((e[5] - e[4]) for e in ev if e[1] == k) * 1e3
            row["rest"] = span - sum(row[k] for k in ("F", "I", "W", "B", "wait", "sends", "meet"))
            rows.append(row)
        per_rank.append({k: statistics.median(r[k] for r in rows) for k in rows[0]})
    return {"label": run["label"], "round": run["round"], "ranks": per_rank}


def gantt(run: dict[str, Any], step: int, unit_ms: float) -> list[str]:
    """One text line per rank: step ``step``'s actions from rank 0's step start, one character
    per ``unit_ms`` (F/I/W/B: chunk 0 upper case, chunk 1 lower case; ``.`` waiting)."""
    starts = [
        next(e[4] for e in events if e[0] == step and e[1] == "step") for events in run["events"]
    ]
    t0 = min(starts)
    S = 2 * len(run["events"])
    lines = []
    for r, events in enumerate(run["events"]):
        cells: list[str] = []
        for e in sorted((e for e in events if e[0] == step), key=lambda e: e[4]):
            if e[1] not in ("F", "I", "W", "B", "wait", "sends", "meet"):
                continue
            a, b = int((e[4] - t0) * 1e3 / unit_ms), int((e[5] - t0) * 1e3 / unit_ms)
            ch = {"wait": ".", "sends": "s", "meet": "m"}.get(e[1], e[1])
            if e[1] in "FIWB" and e[2] >= S // 2:
                ch = ch.lower()
            while len(cells) < b + 1:
                cells.append(" ")
            for i in range(a, b + 1):
                cells[i] = ch
        lines.append(f"r{r} " + "".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--schedule", default="zbv", choices=("zbv", "dualpipev", "interleaved"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=14)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--unit-ms", type=float, default=10.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    G, M = args.global_batch, args.micro_batches
    pairs = build_cases(args.blocks, G, M, args.ranks)
    want = "interleaved1f1b" if args.schedule == "interleaved" else args.schedule
    cases = [c for c in pairs if c["kind"] == want]
    opts = {"rounds": args.rounds, "steps": args.steps, "blocks": args.blocks, "G": G, "M": M}
    print(f"start: {load_note()}")
    runs = run_worker_group(worker, args.ranks, cases, opts)["runs"]
    if args.json:
        Path(args.json).write_text(json.dumps(runs))
    for run in runs:
        s = summarize(run, args.skip)
        print(f"\n{s['label']} round {s['round']}")
        keys = list(s["ranks"][0])
        print("rank " + " ".join(f"{k:>7s}" for k in keys))
        for r, row in enumerate(s["ranks"]):
            print(f"r{r:<3d} " + " ".join(f"{row[k]:7.1f}" for k in keys))
        print("\n".join(gantt(run, args.skip, args.unit_ms)))
    print(f"end: {load_note()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
