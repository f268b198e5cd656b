"""One process, one stage: dapple's runtime vs a plain PyTorch loop, with and without
:func:`dapple.host.host_memory.keep_freed_memory` (CPU, gloo world of one).

The job is ``dapple demo``'s (:mod:`train_real`): the zoo transformer at the demo's sizes, seq
64, G = 16, bf16 autocast, fused AdamW with weight decay, warm-up + cosine, clipping at 1, on a
byte-level corpus of this machine's standard library sources read as a ``TokenFile``.

- ``plain``: a training loop as people write it (``BatchSource`` rows, autocast forward, fp32
  loss, ``backward``, ``clip_grad_norm_``, ``lr_at``, ``step``, ``zero_grad(set_to_none=True)``);
  ``plain (del)``: the same loop dropping its step's tensors (``del logits, loss, x, y``) at the
  end of each step, as the runtime does;
- ``dapple``: :func:`dapple.runtime.run_plan` of a one-device plan on the same data.

Each configuration runs in a fresh process (the allocator setting is per process), alternating
over rounds. Per run: the median step time after 5 warm-up steps, and minor page faults and
kernel (system) CPU time per step over steps 10..49 (``getrusage``).

Usage: ``python benchmarks/host_memory.py [--rounds 3 --steps 50] [--out benchmarks/host_memory.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import HERE, header, load_note

SEQ, G = 64, 16
RUNNERS = ("plain", "plain (del)", "dapple")


def _usage() -> resource.struct_rusage:
    return resource.getrusage(resource.RUSAGE_SELF)


def _run(runner: str, keep: bool, data_path: str, steps: int) -> dict[str, Any]:
    """One run in this process; returns per-step ms and rusage deltas over steps 10..49."""
    import torch
    import torch.distributed as dist

    from dapple.cli.demo_cmd import DEMO_MODEL
    from dapple.core.plan import Plan, StagePlan
    from dapple.datasets import BatchSource, TokenFile
    from dapple.host.host_memory import keep_freed_memory
    from dapple.models.zoo import load_workload
    from dapple.runtime import TrainConfig, run_plan
    from dapple.runtime.optim import lr_at, param_groups, set_lr

    torch.set_num_threads(os.cpu_count() or 1)
    if keep:
        assert keep_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["BENCH_PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    wl = load_workload("transformer", seq=SEQ, **DEMO_MODEL)
    data = TokenFile(data_path, SEQ)
    lo, hi = 10, min(50, steps - 1)
    marks: dict[int, resource.struct_rusage] = {}
    sched = {"lr": 3e-3, "steps": steps, "schedule": "cosine", "warmup_steps": 3, "min_lr": 3e-4}
    if runner == "dapple":
        plan = Plan(
            planner="manual", model_name=wl.name, global_batch_size=G, micro_batch_size=G, num_micro_batches=1,
            stages=(StagePlan(layers=(0, wl.num_layers), devices=(0,)),), schedule="dapple",
        )  # fmt: skip
        cfg = TrainConfig(steps=steps, seed=0, optimizer="adamw", lr=3e-3, weight_decay=0.1,
                          lr_schedule="cosine", min_lr=3e-4, warmup_steps=3, clip_grad_norm=1.0,
                          precision="bf16", device="cpu")  # fmt: skip

        def mark(m: Any) -> None:
            if m.step + 1 in (lo, hi):  # after step s: the start of step s + 1
                marks[m.step + 1] = _usage()

        run = run_plan(plan, wl, cfg, device=torch.device("cpu"), data=data, on_step=mark)
        ms = [m.step_ms for m in run.metrics]
    else:
        model = wl.build_model(0)
        opt = torch.optim.AdamW(param_groups(model.parameters(), 0.1), lr=3e-3, fused=True)
        rows = list(range(G))
        src = BatchSource(data, G, 0, rows, rows, stop=steps)
        ms, t = [], time.perf_counter()
        for step in range(steps):
            if step in (lo, hi):
                marks[step] = _usage()
            x, y = src.batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = wl.loss_fn(logits.float(), y)
            loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            set_lr(opt, lr_at(step, **sched))
            opt.step()
            opt.zero_grad(set_to_none=True)
            float(loss.detach())
            if runner == "plain (del)":
                del logits, loss, x, y
            now = time.perf_counter()
            ms.append((now - t) * 1e3)
            t = now
        src.close()
    dist.destroy_process_group()
    a, b = marks[lo], marks[hi]
    n = hi - lo
    return {
        "ms": ms,
        "faults": (b.ru_minflt - a.ru_minflt) / n,
        "sys_ms": (b.ru_stime - a.ru_stime) / n * 1e3,
    }


def _p10(ms: list[float]) -> float:
    return statistics.quantiles(ms, n=10)[0]


def _child(argv: list[str]) -> None:
    runner, keep, data_path, steps, out = argv
    res = _run(runner, keep == "keep", data_path, int(steps))
    Path(out).write_text(json.dumps(res))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=str(HERE / "host_memory.md"))
    args = ap.parse_args(argv)
    if args.steps < 15:
        ap.error(f"--steps must be >= 15 (faults are counted from step 10), got {args.steps}")
    from dapple.cli._demo_corpus import stdlib_sources
    from dapple.datasets import prepare
    from dapple.runtime import free_port

    cmd = "python benchmarks/host_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = header("One process: dapple vs a plain loop, with and without keep_freed_memory", cmd)
    configs = [(r, k) for k in ("default", "keep") for r in RUNNERS]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in configs}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        prep = prepare(stdlib_sources(2 << 20), Path(tmp) / "train.bin", val_fraction=0.01)
        for rnd in range(args.rounds):
            order = configs if rnd % 2 == 0 else configs[::-1]
            for runner, keep in order:
                out = str(Path(tmp) / "r.json")
                env = {**os.environ, "BENCH_PORT": str(free_port())}
                subprocess.run(
                    [sys.executable, __file__, "--child", runner, keep, str(prep.train),
                     str(args.steps), out], check=True, env=env,
                )  # fmt: skip
                res = json.loads(Path(out).read_text())
                results[(runner, keep)].append(res)
                med = statistics.median(res["ms"][5:])
                print(f"round {rnd} {runner:12s} {keep:8s} {med:6.1f} ms  {res['faults']:7.0f} "
                      f"faults/step  {load_note()}", flush=True)  # fmt: skip
    lines += [
        f"Job: `dapple demo`'s model and optimisation (bf16, fused AdamW, cosine, clipping), "
        f"G = {G}, seq {SEQ}, one process with {os.cpu_count()} intra-op threads; "
        f"{args.steps} steps per run, {args.rounds} rounds, configurations alternating (order "
        "reversed every other round), each in a fresh process. Step time: median of the steps "
        "after 5 warm-up steps, then the median over rounds [range of the per-round medians]; "
        "faults and kernel time: per step over steps 10..49, median over rounds.",
        "",
        "| allocator | runner | step ms [range] | vs plain, same allocator | minor faults / step "
        "| kernel CPU ms / step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for keep in ("default", "keep"):
        base = [statistics.median(r["ms"][5:]) for r in results[("plain", keep)]]
        for runner in RUNNERS:
            rs = results[(runner, keep)]
            meds = [statistics.median(r["ms"][5:]) for r in rs]
            ratio = statistics.median(b / m for b, m in zip(base, meds, strict=True))
            label = "glibc defaults" if keep == "default" else "`keep_freed_memory()`"
            lines.append(
                f"| {label} | {runner} | {statistics.median(meds):.1f} [{min(meds):.1f}-"
                f"{max(meds):.1f}] | {ratio:.2f}x | "
                f"{statistics.median(r['faults'] for r in rs):,.0f} | "
                f"{statistics.median(r['sys_ms'] for r in rs):.1f} |"
            )
    lines += [
        "",
        "Fastest tenth (less sensitive to other jobs on the cores): the 10th percentile of each "
        "run's step times after warm-up, median over rounds, and the ratio on it:",
        "",
        "| allocator | runner | p10 step ms | vs plain |",
        "|---|---|---:|---:|",
    ]
    for keep in ("default", "keep"):
        base = [_p10(r["ms"][5:]) for r in results[("plain", keep)]]
        for runner in RUNNERS:
            p10 = [_p10(r["ms"][5:]) for r in results[(runner, keep)]]
            ratio = statistics.median(b / m for b, m in zip(base, p10, strict=True))
            label = "glibc defaults" if keep == "default" else "`keep_freed_memory()`"
            lines.append(f"| {label} | {runner} | {statistics.median(p10):.1f} | {ratio:.2f}x |")
    lines += [
        "",
        "`vs plain`: the median over rounds of plain's step time / this runner's (above 1: "
        "faster than the plain loop).",
        "",
        f"End: {load_note()}; the script took {time.perf_counter() - t0:.0f} s.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        raise SystemExit(main())
