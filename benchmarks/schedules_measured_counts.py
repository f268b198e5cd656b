"""V schedules counted: what one step of dapple's ZB-V and DualPipeV dispatches per rank against
``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` on the
same chunks, with 1F1B against ``Schedule1F1B`` as the control (CPU, gloo).

Counts, not times: a loaded machine does not move them. The model, the partition and the V are
``schedules_measured_v.py``'s (zoo ``transformer``, ``--blocks`` blocks, a straight pipeline
over P ranks cut into 2P chunks, rank g holding chunks g and 2P-1-g). Each case runs
``--warmup`` steps, then ``--counted`` steps each counted on every rank:

- ``aten::`` ops (``torch.profiler`` CPU events, nested ones included), each given to the
  compute action it ran in: dapple's ``StageExecutor.forward/backward/backward_input/
  backward_weight`` and torch's ``forward_one_chunk`` / ``backward_one_chunk`` (``B`` where
  ``full_backward``, else ``I``) / ``backward_weight_one_chunk``, wrapped in the worker in a
  ``record_function`` of the kind; ``other`` is the rest of the step (messages, the optimizer,
  dapple's step point and metrics, torch's schedule bookkeeping);
- Python calls (``cProfile``);
- the process's CPU ms (``time.process_time``, every thread) of each step, uncounted steps only
  (the counters slow the counted ones): min over them.

dapple's step: its ``run_step``. torch's: ``schedule.step`` + optimizer step + ``zero_grad``.

Usage: ``python benchmarks/schedules_measured_counts.py [--ranks 4] [--out FILE.md]``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (
    BENCH_MODEL,
    bench_transformer,
    header,
    load_note,
    run_worker_group,
    splice_between,
)
from _schedules_worker import TORCH_SCHEDULES, TorchPipe
from dapple.core.plan import Plan, straight_plan
from dapple.simulate.plan_variants import with_schedule
from schedules_measured_v import _commit
from vs_torch_pipelining import LR, even_bounds

PAIRS = (("dapple", "1f1b"), ("zbv", "zbv"), ("dualpipev", "dualpipev"))
"""(dapple schedule, torch runner kind): 1F1B is the control."""
KINDS = ("F", "B", "I", "W", "other")
TAG = "count::"


def _dapple(schedule: str) -> str:
    """The label of dapple's case of ``schedule``."""
    return f"dapple {'1f1b' if schedule == 'dapple' else schedule}"


def build_cases(blocks: int, G: int, M: int, ranks: int) -> list[dict[str, Any]]:
    """The dapple and the torch case of each pair in :data:`PAIRS`, on the same chunks."""
    wl = bench_transformer(layers=blocks)
    b = even_bounds(wl.num_layers, ranks)
    straight = straight_plan(wl.num_layers, b[:-1], global_batch_size=G, num_micro_batches=M)
    cases = []
    for schedule, kind in PAIRS:
        plan = straight if schedule == "dapple" else with_schedule(straight, schedule)
        chunks = [list(st.layers) for st in plan.stages]
        place = [plan.group_of_stage(k) for k in range(len(chunks))]
        cases.append({"label": _dapple(schedule), "runner": "dapple", "plan": plan.to_dict()})
        cases.append(
            {"label": f"torch {TORCH_SCHEDULES[kind]}", "runner": "torch", "kind": kind,
             "chunks": chunks, "placement": place}
        )  # fmt: skip
    return cases


# -- in each worker ---------------------------------------------------------------------------
def _tag_actions() -> None:
    """Wrap every compute action of both runtimes in a ``record_function`` of its kind."""
    import torch
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from dapple.runtime.stage import StageExecutor

    def tagged(fn: Callable[..., Any], kind: Callable[..., str]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(TAG + kind(*args, **kwargs)):
                return fn(*args, **kwargs)

        return wrapper

    for name, k in zip(
        ("forward", "backward", "backward_input", "backward_weight"), "FBIW", strict=True
    ):
        setattr(StageExecutor, name, tagged(getattr(StageExecutor, name), lambda *a, k=k: k))
    for name, k in (("forward_one_chunk", "F"), ("backward_weight_one_chunk", "W")):
        fn = getattr(_PipelineStageBase, name)
        setattr(_PipelineStageBase, name, tagged(fn, lambda *a, k=k, **kw: k))

    def torch_backward(*args: Any, **kwargs: Any) -> str:
        return "B" if kwargs.get("full_backward", args[3] if len(args) > 3 else True) else "I"

    _PipelineStageBase.backward_one_chunk = tagged(  # type: ignore[method-assign]
        _PipelineStageBase.backward_one_chunk, torch_backward
    )


def _kind(event: Any) -> str:
    """The compute action an op ran in (``other``: none)."""
    while event is not None:
        if event.name.startswith(TAG):
            return str(event.name[len(TAG) :])
        event = event.cpu_parent
    return "other"


class _Window:
    """Counts the steps whose index is in ``counted``; times the others' process CPU."""

    def __init__(self, counted: range) -> None:
        self.reset(counted)

    def reset(self, counted: range) -> None:
        """Start a case: its step ``i`` is counted when ``i`` is in ``counted``, timed after."""
        self.counted, self.index = counted, 0
        self.ops: list[dict[str, dict[str, int]]] = []
        self.calls: list[Counter[str]] = []
        self.cpu_ms: list[float] = []

    def around(self, fn: Callable[[], Any]) -> Any:
        import torch

        i, self.index = self.index, self.index + 1
        if i not in self.counted:
            t = time.process_time()
            out = fn()
            if i >= self.counted.stop:  # after the warm-up and the counted steps
                self.cpu_ms.append((time.process_time() - t) * 1e3)
            return out
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        calls = cProfile.Profile()
        with prof:
            calls.enable()
            out = fn()
            calls.disable()
        ops: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
        for e in prof.events():
            if e.name.startswith("aten::"):
                ops[_kind(e)][e.name] += 1
        self.ops.append({k: dict(v) for k, v in ops.items()})
        stats: Any = pstats.Stats(calls)
        self.calls.append(
            Counter({f"{Path(p).name}:{ln}({n})": v[1] for (p, ln, n), v in stats.stats.items()})
        )
        return out


def worker(
    rank: int, world: int, port: int, cases: list[dict[str, Any]], opts: dict[str, Any], out: str
) -> None:
    import torch
    import torch.distributed as dist

    from _bench_common import join_worker_group
    from dapple.runtime import TrainConfig, run_plan, shutdown_distributed
    from dapple.runtime.interpreter import ProgramInterpreter

    join_worker_group(rank, world, port)
    _tag_actions()
    wl = bench_transformer(layers=opts["blocks"])
    warm, n, extra = opts["warmup"], opts["counted"], opts["timed"]
    window = _Window(range(warm, warm + n))
    run_step = ProgramInterpreter.run_step

    def counted_step(interp: ProgramInterpreter, *args: Any, **kwargs: Any) -> Any:
        return window.around(lambda: run_step(interp, *args, **kwargs))

    ProgramInterpreter.run_step = counted_step  # type: ignore[method-assign]
    res: list[dict[str, Any]] = []
    for c in cases:
        window.reset(range(warm, warm + n))
        steps = warm + n + extra
        if c["runner"] == "dapple":
            cfg = TrainConfig(steps=steps, seed=0, optimizer="sgd", lr=LR, device="cpu")
            run_plan(Plan.from_dict(c["plan"]), wl, cfg, device=torch.device("cpu"))
        else:
            pipe = TorchPipe(c["kind"], rank, opts["G"], opts["M"], c["chunks"],
                             c["placement"], opts["blocks"])  # fmt: skip
            dist.barrier()
            for k in range(steps):
                window.around(lambda k=k, pipe=pipe: pipe.step(k))
            dist.barrier()
            del pipe
        mine = {"ops": window.ops, "calls": [dict(x) for x in window.calls],
                "cpu_ms": window.cpu_ms}  # fmt: skip
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        res.append({"label": c["label"], "ranks": every})
        if rank == 0:
            print(f"  {c['label']}: counted ({load_note()})", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"cases": res}))
    shutdown_distributed()


# -- the report -------------------------------------------------------------------------------
def _min_counted(r: dict[str, Any]) -> dict[str, Counter[str]]:
    """Per kind, each op's count in the counted step with the fewest ops (one step)."""
    best = min(r["ops"], key=lambda s: sum(sum(v.values()) for v in s.values()))
    return {k: Counter(best[k]) for k in KINDS}


def _summed(case: dict[str, Any]) -> tuple[dict[str, Counter[str]], int, float]:
    """Over the ranks: ops per kind, Python calls (each rank's fewest) and CPU ms (each
    rank's min over its timed steps)."""
    ops = {k: Counter[str]() for k in KINDS}
    calls, cpu = 0, 0.0
    for r in case["ranks"]:
        for k, v in _min_counted(r).items():
            ops[k].update(v)
        calls += min(sum(c.values()) for c in r["calls"])
        cpu += min(r["cpu_ms"]) if r["cpu_ms"] else float("nan")
    return ops, calls, cpu


def _diffs(a: dict[str, Counter[str]], b: dict[str, Counter[str]], top: int) -> list[str]:
    """The ops whose counts differ most, per kind: ``name a/b``."""
    out = []
    for k in KINDS:
        names = set(a[k]) | set(b[k])
        worst = sorted(names, key=lambda x: (-abs(a[k][x] - b[k][x]), x))[:top]
        cells = [f"`{x[6:]}` {a[k][x]}/{b[k][x]}" for x in worst if a[k][x] != b[k][x]]
        if cells:
            out.append(f"  - {k}: " + ", ".join(cells))
    return out or ["  - none"]


def report(got: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The markdown: a row per case, then per pair the ops that differ (dapple against torch,
    and dapple against its ``--before-src`` version)."""
    lines = [
        f"Model: zoo `transformer` {{**{BENCH_MODEL}, 'layers': {args.blocks}}}, global batch "
        f"{args.global_batch}, M = {args.micro_batches}, plain SGD lr {LR}, {args.ranks} gloo "
        f"processes; {args.warmup} warm-up step(s), {args.counted} counted step(s) (each rank's "
        f"step with the fewest ops), {args.timed} timed step(s) (each rank's min CPU). Ops and "
        "calls summed over the ranks, per step.",
        "",
        "| case | aten ops: F / B / I / W / other | all aten ops | Python calls | "
        "process CPU ms/step (min, all ranks) |",
        "|---|---:|---:|---:|---:|",
    ]
    summed = {c["label"]: _summed(c) for c in got}
    for c in got:
        ops, calls, cpu = summed[c["label"]]
        per = " / ".join(str(sum(ops[k].values())) for k in KINDS)
        total = sum(sum(v.values()) for v in ops.values())
        lines.append(f"| {c['label']} | {per} | {total} | {calls} | {cpu:.0f} |")
    lines += ["", "aten ops whose counts differ (all ranks, one step):", ""]
    for schedule, kind in PAIRS:
        mine, theirs = _dapple(schedule), f"torch {TORCH_SCHEDULES[kind]}"
        for a, b in ((mine, theirs), (f"{mine} (before)", mine)):
            if a in summed and b in summed:
                lines.append(f"- {a} / {b}:")
                lines += _diffs(summed[a][0], summed[b][0], args.top)
    return [*lines, "", f"End: {load_note()}.", ""]


def _before(args: argparse.Namespace) -> list[dict[str, Any]]:
    """dapple's cases counted with ``--before-src`` (a process of its own, that ``src`` first on
    its path), labelled ``(before)``."""
    import os
    import subprocess
    import tempfile

    keep = ("ranks", "blocks", "global_batch", "micro_batches", "warmup", "counted", "timed")
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keep]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        env = {**os.environ, "PYTHONPATH": str(Path(args.before_src).resolve())}
        cmd = [sys.executable, __file__, *flags, "--dapple-only", "--json", str(out)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        got: list[dict[str, Any]] = json.loads(out.read_text())
    return [{**c, "label": c["label"] + " (before)"} for c in got]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=14)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--counted", type=int, default=2)
    ap.add_argument("--timed", type=int, default=4)
    ap.add_argument("--top", type=int, default=8, help="differing ops listed per kind")
    ap.add_argument("--before-src", default=None, help="also count dapple with this src/")
    ap.add_argument("--dapple-only", action="store_true", help="count dapple's cases only")
    ap.add_argument("--out", default=None, help="write the markdown into this file's section")
    ap.add_argument("--json", default=None, help="write every rank's raw counts here")
    args = ap.parse_args(argv)
    text = " ".join(sys.argv[1:] if argv is None else argv)
    head = header("V schedules counted vs torch (CPU, gloo)",
                  f"python benchmarks/schedules_measured_counts.py {text}".strip())  # fmt: skip
    cases = build_cases(args.blocks, args.global_batch, args.micro_batches, args.ranks)
    if args.dapple_only:
        cases = [c for c in cases if c["runner"] == "dapple"]
    opts = {"blocks": args.blocks, "G": args.global_batch, "M": args.micro_batches,
            "warmup": args.warmup, "counted": args.counted, "timed": args.timed}  # fmt: skip
    before = _before(args) if args.before_src else []
    got = run_worker_group(worker, args.ranks, cases, opts)["cases"]
    if args.json:
        Path(args.json).write_text(json.dumps(got))
    got = [*before, *got]
    commit = f"- commit: `{_commit()}` at start (`+dirty`: the working tree as run differs from it)"
    section = ["## V schedules counted against torch", "", *head[2:-1], commit, "",
               *report(got, args)]  # fmt: skip
    if args.out:
        splice(Path(args.out), section)
    print("\n".join(section))
    return 0


BEGIN = "<!-- schedules_measured_counts.py: begin -->"
END = "<!-- schedules_measured_counts.py: end -->"


def splice(md: Path, section: list[str]) -> None:
    """Write ``section`` into ``md`` between :data:`BEGIN` and :data:`END`
    (:func:`_bench_common.splice`)."""
    splice_between(md, section, BEGIN, END)


if __name__ == "__main__":
    raise SystemExit(main())
