"""dapple's per-step overhead against plain training loops, before and after issue 46.

One rank, one stage, on CPU. Three ways to train the same model on the same batches
(``make_batch(G, seed + step)``, M micro-batches of G/M rows, gradients accumulated, one fused
AdamW step from :func:`dapple.runtime.optim.make_optimizer`, fp32):

- ``dapple``: :func:`dapple.runtime.run_plan` of a 1-stage plan (metrics and the non-finite
  guard on, as always); ms per step: ``StepMetrics.step_ms``;
- ``plain pieces``: a plain loop over the traced pieces (``Workload.build_model``);
- ``plain module``: a plain loop over the original ``nn.Module`` the pieces were traced from.
  Both plain loops read their loss once per step (as a loop that logs it) and time their step
  from ``make_batch`` to after the optimizer step.

The original module is a GPT-style model (the zoo transformer's embedding, blocks and head in
an ``nn.ModuleList``), cut into pieces by :func:`dapple.models.split.workload_from_module`.
``tiny`` is small enough that the fixed per-step costs dominate; ``medium`` is compute-bound.

Two versions of dapple run side by side: ``after`` (this checkout) and ``before`` (a checkout
of the commit before issue 46, ``git worktree add /tmp/before 81351c0``, passed as
``--before-src /tmp/before/src``). Each round starts one process per version (the order
alternates) and each process runs the three contenders one after another, each for
``--warmup`` + ``--steps`` steps, then the two loops step by step (one dapple step, one
plain step, alternating: ``_interleaved_ms``; the paired ratios), then an *instrumented*
dapple run (not used for the ratios):

- phases: exclusive wall time in the runtime's methods (forward, backward, the guard's checks,
  the step's collective, the gradient norm, clipping, the optimizer step, memory probes, the
  metrics line, the batch), by wrappers that subtract nested phases; the rest of the step is
  the program interpreter's own loop (dispatch, zeroing the gradients, sends and receives);
  micro-batch slicing (inside the forward) is also timed alone;
- host synchronisations: calls of ``Tensor.item``/``__float__``/``__int__``/``__bool__``/
  ``tolist``/``cpu``/``numpy`` per step (each a device sync on CUDA), and where they came from.

Usage::

    git worktree add /tmp/before 81351c0
    python benchmarks/runtime_overhead.py --before-src /tmp/before/src
        [--rounds 3] [--steps 15] [--warmup 3] [--models tiny,medium] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _bench_common import git_in, json_child

ROOT = Path(__file__).resolve().parent.parent
MODELS: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 256, "G": 8, "M": 4},
    "medium": {"layers": 4, "hidden": 256, "heads": 8, "seq": 128, "vocab": 2048, "G": 8, "M": 4},
}
SEED = 0
THREADS = 1
"""torch threads per process: one, so that a loaded machine's other jobs do not turn the
intra-op thread pool's waits into the measurement (every contender runs the same)."""
READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")
GRAD_NORM_EVERY = 1
"""``TrainConfig.grad_norm_every`` of the ``after`` version's dapple runs (``--grad-norm-every``;
1, the default, leaves it out of the config, so a ``before`` version without the field runs)."""

PHASES: list[tuple[str, str, str]] = [
    ("dapple.runtime.stage", "StageExecutor.forward", "forward (F: slicing, layers, loss)"),
    ("dapple.runtime.stage", "StageExecutor.backward", "backward (B)"),
    ("dapple.runtime.longrun", "LongRun.watch", "guard: after F/B (before: checks per B)"),
    ("dapple.runtime.longrun", "LongRun.agree_finite", "step collective: verdict, metric rows"),
    ("dapple.runtime.guard", "NonFiniteGuard.watch", "guard: after F/B (before: checks per B)"),
    (
        "dapple.runtime.guard",
        "NonFiniteGuard.agree_finite",
        "step collective: verdict, metric rows",
    ),
    ("dapple.runtime.optim", "ModelUpdate.global_norm", "gradient norm"),
    ("dapple.runtime.optim", "ModelUpdate.local_sq_norm", "gradient norm"),
    ("dapple.runtime.optim", "ModelUpdate.set_norm", "gradient norm"),
    ("dapple.runtime.optim", "ModelUpdate.local_nonfinite_part", "gradient norm"),
    ("dapple.runtime.optim", "ModelUpdate.step", "clipping and lr"),
    ("torch.optim", "AdamW.step", "optimizer step"),
    ("dapple.runtime.metrics", "StepProbe.begin", "memory probes and step clock"),
    ("dapple.runtime.metrics", "StepProbe.peak_bytes", "memory probes and step clock"),
    ("dapple.runtime.metrics", "StepProbe.resident_peak_bytes", "memory probes and step clock"),
    ("dapple.runtime.metrics", "StepProbe.lap", "memory probes and step clock"),
    ("dapple.runtime.metrics", "MetricsSink.record", "event lines (step line, JSON, callbacks)"),
    ("dapple.runtime.optim", "ModelUpdate.take_report", "loss and metric reads"),
    ("dapple.runtime.engine", "target_tokens", "loss and metric reads"),
    ("dapple.runtime.rank", "Batches.batch", "batch (make_batch, shape check)"),
]
"""(module, attribute, phase): what the instrumented run times (absent ones are skipped: the
guard's methods moved from ``LongRun`` to ``NonFiniteGuard``, and both versions are timed)."""
READ_PHASE = "host reads (item, float, int, bool, tolist)"
REST = "program interpreter's own loop and the rest"


# -- the child: one version of dapple, one model ------------------------------------------------
def _model(size: dict[str, int]) -> tuple[Any, Callable[[], Any]]:
    """The workload of traced pieces and the factory of the original module."""
    import torch
    from torch import nn

    from dapple.models.split import workload_from_module
    from dapple.models.zoo.common import generator, token_cross_entropy
    from dapple.models.zoo.transformer import Block, Embedding, LMHead

    h, seq, vocab = size["hidden"], size["seq"], size["vocab"]

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = Embedding(vocab, h, seq)
            self.blocks = nn.ModuleList(
                Block(h, size["heads"], 4 * h) for _ in range(size["layers"])
            )
            self.head = LMHead(h, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def make_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (n, seq + 1), generator=generator(seed))
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()

    wl = workload_from_module(GPT, make_batch, token_cross_entropy, name="gpt")
    return wl, GPT


def _config(steps: int) -> Any:
    from dapple.runtime import TrainConfig

    every = {"grad_norm_every": GRAD_NORM_EVERY} if GRAD_NORM_EVERY != 1 else {}
    return TrainConfig(steps=steps, seed=SEED, optimizer="adamw", lr=1e-4, timeout_s=120, **every)


def _plain_step(model: Any, wl: Any, size: dict[str, int], steps: int) -> Any:
    """One step of a plain loop per call (``step(k)``): make_batch to after the optimizer step."""
    from dapple.runtime.optim import make_optimizer

    G, M = size["G"], size["M"]
    b = G // M
    params = list(model.parameters())
    opt = make_optimizer(_config(steps), params)

    def step(k: int) -> None:
        x, y = wl.make_batch(G, SEED + k)
        for p in params:
            p.grad = None
        total = 0.0
        for m in range(M):
            loss = wl.loss_fn(model(x[m * b : (m + 1) * b]), y[m * b : (m + 1) * b]) * (b / G)
            loss.backward()
            total = total + loss.detach()
        opt.step()
        float(total)  # its one read per step

    return step


def _plain_ms(model: Any, wl: Any, size: dict[str, int], steps: int) -> list[float]:
    """A plain loop: ms per step from make_batch to after the optimizer step."""
    step = _plain_step(model, wl, size, steps)
    out = []
    for k in range(steps):
        t0 = time.perf_counter()
        step(k)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _interleaved_ms(wl: Any, size: dict[str, int], steps: int) -> dict[str, list[float]]:
    """dapple's steps and a plain loop's (over the same pieces) one after the other in one
    process: each dapple step's ``on_step`` runs one plain step. A dapple step is the time from
    the end of the previous plain step to its own ``on_step`` (all of it: batch, interpreter,
    collective, optimizer, metrics line), so a slow spell of the machine falls on both loops
    alike. Returns per step, by key: ``plain``/``dapple`` wall ms and ``plain cpu``/``dapple
    cpu`` ms of the process's CPU time (``time.process_time``, all its threads: what the step
    cost this process, whatever else ran on the machine meanwhile)."""
    plain = _plain_step(wl.build_model(SEED + 1), wl, size, steps)
    out: dict[str, list[float]] = {"plain": [], "dapple": [], "plain cpu": [], "dapple cpu": []}
    mark = [0.0, 0.0]

    def on_step(metrics: Any) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        if mark[0]:
            out["dapple"].append((t0 - mark[0]) * 1e3)
            out["dapple cpu"].append((c0 - mark[1]) * 1e3)
        plain(metrics.step)
        t1, c1 = time.perf_counter(), time.process_time()
        out["plain"].append((t1 - t0) * 1e3)
        out["plain cpu"].append((c1 - c0) * 1e3)
        mark[:] = [t1, c1]

    _dapple(wl, size, steps + 1, on_step)  # the first step has no start mark
    out["plain"], out["plain cpu"] = out["plain"][1:], out["plain cpu"][1:]
    return out


def _dapple(wl: Any, size: dict[str, int], steps: int, on_step: Any = None) -> list[float]:
    import torch

    from dapple.core.plan import straight_plan
    from dapple.runtime import run_plan

    plan = straight_plan(wl.num_layers, [0], global_batch_size=size["G"],
                         num_micro_batches=size["M"])  # fmt: skip
    run = run_plan(plan, wl, _config(steps), device=torch.device("cpu"), on_step=on_step)
    return [m.step_ms for m in run.metrics]


class _Phases:
    """Exclusive wall time per phase (nested phases subtracted) and host reads by site."""

    def __init__(self) -> None:
        self.ms: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self._stack: list[float] = []  # time spent in nested phases, per open phase
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, phase: str, site: bool = False) -> None:
        f = getattr(owner, attr)

        @functools.wraps(f)  # its attributes too: torch's `hooked` mark on an optimizer's
        def timed(*args: Any, **kw: Any) -> Any:  # step, or torch hooks the wrapper again
            if site:
                caller = sys._getframe(1)
                self.reads[
                    f"{attr} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
                ] += 1
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                took = time.perf_counter() - t0
                nested = self._stack.pop()
                self.ms[phase] += (took - nested) * 1e3
                if self._stack:
                    self._stack[-1] += took

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, f))

    def install(self) -> None:
        import importlib

        import torch

        for module, path, phase in PHASES:
            try:
                owner: Any = importlib.import_module(module)
            except ModuleNotFoundError:  # a module the other version does not have
                continue
            *outer, attr = path.split(".")
            for name in outer:
                owner = getattr(owner, name, None)
            if owner is not None and hasattr(owner, attr):
                self.wrap(owner, attr, phase)
        for name in READS:
            self.wrap(torch.Tensor, name, READ_PHASE, site=True)

    def remove(self) -> None:
        for owner, attr, f in reversed(self._undo):
            setattr(owner, attr, f)
        self._undo = []

    def reset(self) -> None:
        self.ms.clear()
        self.reads.clear()


def _instrumented(wl: Any, size: dict[str, int], warmup: int, steps: int) -> dict[str, Any]:
    """One dapple run with the phases timed, from the end of the warm-up to the last step."""
    ph = _Phases()
    mark: dict[str, float] = {}

    def on_step(m: Any) -> None:
        if m.step == warmup - 1:
            ph.reset()
            mark["t0"] = time.perf_counter()
        elif m.step == warmup + steps - 1:
            mark["t1"] = time.perf_counter()
            mark["ms"] = sum(ph.ms.values())
            mark["reads"] = sum(ph.reads.values())
            mark["phases"] = dict(ph.ms)  # type: ignore[assignment]
            mark["sites"] = dict(ph.reads)  # type: ignore[assignment]

    ph.install()
    try:
        _dapple(wl, size, warmup + steps, on_step)
    finally:
        ph.remove()
    wall = (mark["t1"] - mark["t0"]) * 1e3 / steps
    phases = {k: v / steps for k, v in mark["phases"].items()}  # type: ignore[attr-defined]
    phases[REST] = wall - sum(phases.values())
    return {"wall_ms": wall, "phases": phases, "syncs": mark["reads"] / steps,
            "sites": {k: v / steps for k, v in mark["sites"].items()}}  # type: ignore[attr-defined]  # fmt: skip


def _slicing_ms(wl: Any, size: dict[str, int], reps: int = 50) -> float:
    """The forward's micro-batch slicing alone: M row slices of inputs and targets, copied."""
    G, M = size["G"], size["M"]
    b = G // M
    x, y = wl.make_batch(G, SEED)
    t0 = time.perf_counter()
    for _ in range(reps):
        for m in range(M):
            x[m * b : (m + 1) * b].to("cpu", copy=True)
            y[m * b : (m + 1) * b].to("cpu", copy=True)
    return (time.perf_counter() - t0) * 1e3 / reps


def child(model: str, warmup: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(THREADS)
    size = MODELS[model]
    wl, original = _model(size)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        n = warmup + steps
        torch.manual_seed(SEED)
        res: dict[str, Any] = {
            "plain pieces": _plain_ms(wl.build_model(SEED), wl, size, n)[warmup:],
            "plain module": _plain_ms(original(), wl, size, n)[warmup:],
            "dapple": _dapple(wl, size, n)[warmup:],
        }
        for key, values in _interleaved_ms(wl, size, n).items():
            res[f"interleaved {key}"] = values[warmup:]
        res["instrumented"] = _instrumented(wl, size, warmup, steps)
        res["slicing_ms"] = _slicing_ms(wl, size)
    finally:
        dist.destroy_process_group()
    return res


# -- the driver -------------------------------------------------------------------------------
def _run_child(src: Path, model: str, warmup: int, steps: int, every: int = 1) -> dict[str, Any]:
    args = [model, "--warmup", str(warmup), "--steps", str(steps), "--grad-norm-every", str(every)]
    result: dict[str, Any] = json_child(__file__, src, args, f"child {src} {model}")
    return result


def _report(results: dict[str, dict[str, list[dict[str, Any]]]], args: Any,
            loads: list[tuple[float, ...]], versions: dict[str, str]) -> str:  # fmt: skip
    med = statistics.median
    lines = [
        "# dapple's per-step overhead against plain loops (issue 46)",
        "",
        f"Command: `python benchmarks/runtime_overhead.py --before-src {args.before_src} "
        f"--rounds {args.rounds} --steps {args.steps} --warmup {args.warmup} "
        f"--models {args.models}"
        + (f" --grad-norm-every {args.grad_norm_every}" if args.grad_norm_every != 1 else "")
        + "`",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {os.cpu_count()} "
        f"CPU cores, torch {_torch_version()}; versions: "
        + ", ".join(f"{k} = {v}" for k, v in versions.items()),
        "",
        f"**The machine was shared with other agents' jobs**: load average (1, 5, 15 min) at "
        f"the start {loads[0]}, at the end {loads[-1]}. Ratios come from interleaved rounds in "
        "one run, but a loaded 2-core box moves them by several percent; re-run when quiet.",
        "",
        f"One rank, one stage, CPU ({THREADS} torch thread per process), fp32, fused AdamW, M "
        "micro-batches of G/M rows; median ms per "
        f"step over {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up steps. "
        "Speed ratio = plain ms / dapple ms (1.00: as fast as the plain loop). "
        + (
            f"The after version's dapple runs with grad_norm_every {args.grad_norm_every}: the "
            "gradient norm on every "
            f"{args.grad_norm_every}th step only, a fused finiteness check on the others."
            if args.grad_norm_every != 1
            else "Both versions compute the gradient norm on every step."
        ),
        "",
        "| model | version | plain module ms | plain pieces ms | dapple ms | vs pieces | "
        "vs module | host syncs / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, by_version in results.items():
        for version, runs in by_version.items():
            p = med([x for r in runs for x in r["plain pieces"]])
            o = med([x for r in runs for x in r["plain module"]])
            d = med([x for r in runs for x in r["dapple"]])
            s = statistics.mean(r["instrumented"]["syncs"] for r in runs)
            lines.append(f"| {model} | {version} | {o:.2f} | {p:.2f} | {d:.2f} | {p / d:.3f} | "
                         f"{o / d:.3f} | {s:g} |")  # fmt: skip
    lines += [
        "",
        "Step by step, in one process (``_interleaved_ms``: each dapple step's ``on_step`` runs "
        "one plain step over the same pieces, so a slow spell of the machine falls on both): "
        "the paired ratio is the median over steps of plain ms / dapple ms of adjacent steps, "
        "with its 25th-75th percentiles. Two clocks: wall time, and the process's CPU time "
        "(``time.process_time``, all its threads), which leaves out the time other programs "
        "held the cores.",
        "",
        "| model | version | clock | plain ms | dapple ms | paired ratio | IQR |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, by_version in results.items():
        for version, runs in by_version.items():
            for clock, suffix in (("wall", ""), ("CPU", " cpu")):
                if f"interleaved dapple{suffix}" not in runs[0]:
                    continue
                pairs = [(a, b) for r in runs for a, b in zip(
                    r[f"interleaved plain{suffix}"], r[f"interleaved dapple{suffix}"], strict=True)]  # fmt: skip
                ratios = sorted(a / b for a, b in pairs if b > 0)
                q1, _, q3 = statistics.quantiles(ratios, n=4)
                lines.append(f"| {model} | {version} | {clock} | {med([a for a, _ in pairs]):.2f} "
                             f"| {med([b for _, b in pairs]):.2f} | {med(ratios):.3f} | "
                             f"{q1:.3f}-{q3:.3f} |")  # fmt: skip
    for model, by_version in results.items():
        size = MODELS[model]
        lines += ["", f"## {model}: {size}", "", "Phases of dapple's step (instrumented run, mean "
                  "ms per step; exclusive: nested phases subtracted):", ""]  # fmt: skip
        names: list[str] = []
        for runs in by_version.values():
            for r in runs:
                names += [k for k in r["instrumented"]["phases"] if k not in names]
        head = " | ".join(f"{v} ms | {v} share" for v in by_version)
        lines += [f"| phase | {head} |", "|---|" + "---|---|" * len(by_version)]
        walls = {v: statistics.mean(r["instrumented"]["wall_ms"] for r in runs)
                 for v, runs in by_version.items()}  # fmt: skip
        for name in sorted(names, key=lambda n: (n == REST, n)):
            cells = []
            for v, runs in by_version.items():
                ms = statistics.mean(r["instrumented"]["phases"].get(name, 0.0) for r in runs)
                cells.append(f"{ms:.3f} | {100 * ms / walls[v]:.1f}%")
            lines.append(f"| {name} | {' | '.join(cells)} |")
        lines.append(
            f"| **step (instrumented)** | {' | '.join(f'{w:.3f} | 100%' for w in walls.values())} |"
        )
        for v, runs in by_version.items():
            sl = statistics.mean(r["slicing_ms"] for r in runs)
            sites: Counter[str] = Counter()
            for r in runs:
                sites.update(r["instrumented"]["sites"])
            where = (
                ", ".join(f"{n / len(runs):g} x `{k}`" for k, n in sites.most_common()) or "none"
            )
            lines += ["", f"- {v}: micro-batch slicing alone {sl:.3f} ms per step (inside F); "
                      f"host reads per step: {where}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--before-src", type=Path, default=Path("/tmp/before/src"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"))
    ap.add_argument("--grad-norm-every", type=int, default=1,
                    help="the after version's TrainConfig.grad_norm_every (default 1)")  # fmt: skip
    args = ap.parse_args()
    if args.child:
        global GRAD_NORM_EVERY
        GRAD_NORM_EVERY = args.grad_norm_every
        print(json.dumps(child(args.child, args.warmup, args.steps)))
        return
    srcs = {"after": ROOT / "src", "before": args.before_src}
    versions = {v: f"{git_in(s, 'rev-parse', '--short', 'HEAD')} ({s})" for v, s in srcs.items()}
    loads = [os.getloadavg()]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for model in args.models.split(","):
        results[model] = {"before": [], "after": []}
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 else ["after", "before"]
            for v in order:
                every = args.grad_norm_every if v == "after" else 1
                res = _run_child(srcs[v], model, args.warmup, args.steps, every)
                results[model][v].append(res)
                print(f"{model} round {r} {v}: dapple {statistics.median(res['dapple']):.2f} ms, "
                      f"pieces {statistics.median(res['plain pieces']):.2f} ms, syncs "
                      f"{res['instrumented']['syncs']:g}", flush=True)  # fmt: skip
    loads.append(os.getloadavg())
    text = _report(results, args, [tuple(round(x, 2) for x in la) for la in loads], versions)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
