"""Per-rank action timelines of dapple's and torch's V schedules on the same straight partition
(CPU, gloo): where each rank computes, waits for a message, and idles between steps.

A diagnostic beside ``schedules_measured_v.py`` (same model, chunks and worker group). Four
cases in ONE process group, in rounds whose order alternates: dapple's schedule, torch's,
torch's with a step point added (after its optimizer step every rank joins a world all_gather of
a 9-number row read on the host, as dapple's :meth:`NonFiniteGuard.agree_finite` is), and
dapple's without the non-finite guard (``on_nonfinite="off"``: its rows gathered
asynchronously and read a step late, :mod:`dapple.runtime.late_rows`). Every
compute action (F, I, W, B) and every wait is timed on each rank (``time.perf_counter``: one
clock for all processes of the machine): dapple's ``StageExecutor.forward/backward/
backward_input/backward_weight`` minus their receive waits (``StageLinks.wait_concat``), the
step's sends (``finish_sends``) and collective (``ProgramInterpreter._meet``); torch's
``forward_one_chunk/backward_one_chunk/backward_weight_one_chunk`` and ``_wait_batch_p2p``.

Per case and round (medians over the steps after the warm-up):

- ``ms/step``: the slowest rank's period between consecutive step ends;
- ``r0 idle between steps``: rank 0 from its last compute of a step to its first of the next;
- ``r0 starts next``: rank 0's first compute of step s+1 minus the last compute of step s on any
  rank (negative: consecutive steps overlap);
- ``cores idle``: ms per step in which fewer ranks than cores are outside a wait (a core has
  nothing of this job to run);
- wall ms per step, all ranks summed, in compute (F, I, W, B), in waits (messages, the step's
  sends and collective) and in posting sends and receives (dapple's ``comm.isend/irecv``,
  torch's ``_batch_p2p``).

Usage: ``python benchmarks/schedules_measured_timeline.py --ranks 4 --schedule zbv
[--rounds 6 --steps 4] [--out FILE.md] [--json FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (
    bench_transformer,
    header,
    join_worker_group,
    load_note,
    run_worker_group,
    splice_between,
)
from _schedules_worker import TorchPipe
from dapple.core.plan import Plan
from schedules_measured_v import _commit, build_cases
from vs_torch_pipelining import LR

BEGIN = "<!-- schedules_measured_timeline.py: begin -->"
END = "<!-- schedules_measured_timeline.py: end -->"
WAITS = ("wait", "sends", "meet")
"""Event kinds in which a rank waits (sleeps) rather than computes."""

Event = tuple[int, str, int, int, float, float]
"""``(step, kind, stage, micro-batch, t0, t1)``: kind F/I/W/B (compute, waits excluded), one of
:data:`WAITS`, ``post`` (posting sends and receives) or ``step`` (the whole step)."""


class Recorder:
    """This process's timed :data:`Event`s."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.step = -1
        self.waited = 0.0

    def add(self, kind: str, stage: int, m: int, t0: float, t1: float) -> None:
        self.events.append((self.step, kind, stage, m, t0, t1))

    def compute(self, fn: Callable[..., Any], kind: str, stage_of: Callable[..., int]) -> Any:
        """``fn(obj, action or micro-batch, ...)`` wrapped: recorded as ``kind`` from the end of
        the waits inside it to its end."""

        def wrapper(obj: Any, a: Any, *args: Any, **kw: Any) -> Any:
            before, t0 = self.waited, time.perf_counter()
            try:
                return fn(obj, a, *args, **kw)
            finally:
                m = a if isinstance(a, int) else getattr(a, "micro_batch", -1)
                self.add(kind, stage_of(obj, a), m, t0 + self.waited - before, time.perf_counter())

        return wrapper

    def timed(self, fn: Callable[..., Any], kind: str) -> Any:
        """``fn`` wrapped: its span recorded as ``kind`` (not a wait)."""

        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.add(kind, -1, -1, t0, time.perf_counter())

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

    def d_stage(ex: Any, a: Any) -> int:
        return int(a.stage)

    for name, k in (("forward", "F"), ("backward", "B"), ("backward_input", "I"),
                    ("backward_weight", "W")):  # fmt: skip
        setattr(StageExecutor, name, rec.compute(getattr(StageExecutor, name), k, d_stage))
    StageLinks.wait_concat = rec.wait(StageLinks.wait_concat)  # type: ignore[method-assign]
    StageExecutor.finish_sends = rec.wait(StageExecutor.finish_sends, "sends")  # type: ignore[method-assign]
    ProgramInterpreter._meet = rec.wait(ProgramInterpreter._meet, "meet")  # type: ignore[method-assign]
    run_step = ProgramInterpreter.run_step

    def stepped(interp: Any, step: int, *a: Any, **kw: Any) -> Any:
        rec.step = step
        t0 = time.perf_counter()
        try:
            return run_step(interp, step, *a, **kw)
        finally:
            rec.add("step", -1, -1, t0, time.perf_counter())

    ProgramInterpreter.run_step = stepped  # type: ignore[method-assign]

    def t_stage(st: Any, m: int) -> int:
        return int(st.stage_index)

    _PipelineStageBase.forward_one_chunk = rec.compute(  # type: ignore[method-assign]
        _PipelineStageBase.forward_one_chunk, "F", t_stage
    )
    bwd = _PipelineStageBase.backward_one_chunk

    def backward_one_chunk(st: Any, m: int, *a: Any, **kw: Any) -> Any:
        full = kw.get("full_backward", a[1] if len(a) > 1 else True)
        return rec.compute(bwd, "B" if full else "I", t_stage)(st, m, *a, **kw)

    _PipelineStageBase.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]
    _PipelineStageBase.backward_weight_one_chunk = rec.compute(  # type: ignore[method-assign]
        _PipelineStageBase.backward_weight_one_chunk, "W", t_stage
    )
    tsched._wait_batch_p2p = rec.wait(tsched._wait_batch_p2p)
    # posting messages: not a wait, timed to tell it from the rest of the runtime's own work
    tsched._batch_p2p = rec.timed(tsched._batch_p2p, "post")
    from dapple.runtime import comm

    comm.isend = rec.timed(comm.isend, "post")
    comm.irecv = rec.timed(comm.irecv, "post")


def _torch_steps(peer: TorchPipe, rec: Recorder, first: int, steps: int, point: bool) -> None:
    """``steps`` back-to-back steps of ``peer``; with ``point``, each ends in a world all_gather
    of a 9-number row read on the host (dapple's step point, :meth:`agree_finite`)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    for k in range(steps):
        rec.step = k
        t0 = time.perf_counter()
        peer.step(first + k)
        if point:
            t = time.perf_counter()
            row = torch.zeros(9, dtype=torch.float64)
            rows = [torch.empty_like(row) for _ in range(world)]
            dist.all_gather(rows, row)
            torch.stack(rows).tolist()
            rec.add("meet", -1, -1, t, time.perf_counter())
        rec.add("step", -1, -1, t0, time.perf_counter())


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
    steps = opts["steps"]
    for rnd in range(opts["rounds"]):
        for c in cases if rnd % 2 == 0 else cases[::-1]:
            rec.events = []
            dist.barrier()
            if c["runner"] == "dapple":
                cfg = TrainConfig(steps=steps, seed=rnd, optimizer="sgd", lr=LR, device="cpu",
                                  **c.get("train", {}))  # fmt: skip
                run_plan(Plan.from_dict(c["plan"]), wl, cfg, device=torch.device("cpu"))
            else:
                if peer is None:
                    peer = TorchPipe(c["kind"], rank, opts["G"], opts["M"], c["chunks"],
                                     c["placement"], opts["blocks"])  # fmt: skip
                _torch_steps(peer, rec, rnd * steps, steps, c.get("point", False))
            got: list[Any] = [None] * world
            dist.all_gather_object(got, rec.events)
            if rank == 0:
                runs.append({"label": c["label"], "round": rnd, "events": got})
                print(f"  round {rnd} {c['label']} ({load_note()})", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"runs": runs}))
    peer = None  # the stages hold the process group: drop them before leaving it
    shutdown_distributed()


# -- analysis -----------------------------------------------------------------------------------
def _compute(events: list[Event], s: int) -> list[Event]:
    return [e for e in events if e[0] == s and e[1] in ("F", "I", "W", "B")]


def cores_idle_ms(ranks: list[list[Event]], t0: float, t1: float, cores: int) -> float:
    """ms in [t0, t1] in which fewer than ``cores`` ranks are outside a wait."""
    waits = [e for ev in ranks for e in ev if e[1] in WAITS and e[5] > t0 and e[4] < t1]
    edges = sorted([(max(e[4], t0), -1) for e in waits] + [(min(e[5], t1), 1) for e in waits])
    running, last, idle = len(ranks), t0, 0.0
    for t, d in [*edges, (t1, 0)]:
        idle += max(0, cores - running) * (t - last)
        running += d
        last = t
    return idle * 1e3


def measures(run: dict[str, Any], skip: int, cores: int) -> dict[str, float]:
    """The module docstring's measures of one case in one round."""
    ranks: list[list[Event]] = run["events"]
    ends = [sorted(e[5] for e in ev if e[1] == "step") for ev in ranks]
    n = len(ends[0])
    period = max(
        statistics.median(b - a for a, b in zip(e[skip - 1 : -1], e[skip:], strict=True))
        for e in ends
    )
    idle, lead = [], []
    for s in range(skip, n - 1):
        r0_end = max(e[5] for e in _compute(ranks[0], s))
        r0_next = min(e[4] for e in _compute(ranks[0], s + 1))
        last = max(max(e[5] for e in _compute(ev, s)) for ev in ranks)
        idle.append(r0_next - r0_end)
        lead.append(r0_next - last)
    t0, t1 = min(e[skip - 1] for e in ends), min(e[-1] for e in ends)

    def wall_ms(kinds: tuple[str, ...]) -> float:
        """ms per step in ``kinds``, all ranks summed (steps after the warm-up)."""
        total = sum(e[5] - e[4] for ev in ranks for e in ev if e[1] in kinds and e[0] >= skip)
        return total * 1e3 / (n - skip)

    return {
        "ms": period * 1e3,
        "r0_idle": statistics.median(idle) * 1e3,
        "r0_lead": statistics.median(lead) * 1e3,
        "cores_idle": cores_idle_ms(ranks, t0, t1, cores) / (n - skip),
        "compute": wall_ms(("F", "I", "W", "B")),
        "waits": wall_ms(WAITS),
        "post": wall_ms(("post",)),
    }


def report(runs: list[dict[str, Any]], args: argparse.Namespace, head: list[str]) -> list[str]:
    """The markdown section: per case the medians over rounds, then the rounds' ratios."""
    cores = os.cpu_count() or 1
    got: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        got.setdefault(run["label"], []).append(measures(run, args.skip, cores))
    labels = list(got)
    rows = [
        "| case | ms/step | r0 idle between steps (ms) | r0 starts next step (ms after the "
        "last rank's last compute) | cores idle (ms/step) | all ranks, wall ms/step: compute "
        "F+I+W+B / waits / posting messages |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        med = {k: statistics.median(m[k] for m in got[label]) for k in got[label][0]}
        rows.append(
            f"| {label} | {med['ms']:.0f} | {med['r0_idle']:.0f} | {med['r0_lead']:+.0f} | "
            f"{med['cores_idle']:.0f} | {med['compute']:.0f} / {med['waits']:.0f} / "
            f"{med['post']:.0f} |"
        )
    ref = labels[0]
    ratios = []
    for label in labels[1:]:
        r = [b["ms"] / a["ms"] for a, b in zip(got[ref], got[label], strict=True)]
        ratios.append(
            f"- {label} ms / {ref} ms: median **{statistics.median(r):.3f}** "
            f"[{min(r):.2f}-{max(r):.2f}] over rounds ({', '.join(f'{x:.2f}' for x in r)})"
        )
    return [
        f"## Timelines: {args.schedule} on {args.ranks} ranks, dapple vs torch",
        "",
        *head[2:-1],
        f"- commit: `{_commit()}` at start",
        "",
        f"Model and chunks as `schedules_measured_v.py --ranks {args.ranks}` (M = "
        f"{args.micro_batches}, global batch {args.global_batch}); {args.rounds} rounds x "
        f"{args.steps} steps per case, the order alternating, the first {args.skip} step(s) of "
        "each round dropped; medians over rounds. Measures: see the script's docstring.",
        "",
        *rows,
        "",
        *ratios,
        "",
        f"End: {load_note()}.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--schedule", default="zbv", choices=("zbv", "dualpipev"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=14)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--out", default="", help="markdown file to write the section into")
    ap.add_argument("--json", default="", help="write every event here")
    args = ap.parse_args(argv)
    if args.skip < 1 or args.steps < args.skip + 2:
        raise SystemExit(f"need skip >= 1 and steps >= skip + 2, got {args.skip}, {args.steps}")
    G, M = args.global_batch, args.micro_batches
    pairs = build_cases(args.blocks, G, M, args.ranks)
    dapple, torch_case = (c for c in pairs[:6] if c["kind"] == args.schedule)
    point = {**torch_case, "label": torch_case["label"] + " + step point", "point": True}
    off = {**dapple, "label": dapple["label"] + ", on_nonfinite off",
           "train": {"on_nonfinite": "off"}}  # fmt: skip
    cases = [dapple, torch_case, point, off]
    opts = {"rounds": args.rounds, "steps": args.steps, "blocks": args.blocks, "G": G, "M": M}
    command = "python benchmarks/schedules_measured_timeline.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    head = header("timelines", command.strip())
    runs = run_worker_group(worker, args.ranks, cases, opts)["runs"]
    if args.json:
        Path(args.json).write_text(json.dumps(runs))
    section = report(runs, args, head)
    if args.out:
        md = Path(args.out)
        splice_between(md, section, BEGIN, END)
    print("\n".join(section))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
