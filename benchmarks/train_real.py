"""Training throughput on real data: dapple's planned plan vs ``DistributedDataParallel`` (CPU, gloo).

The job is ``dapple demo``'s: the zoo transformer at :data:`dapple.cli.demo_cmd.DEMO_MODEL` sizes,
``seq = 64``, trained on a byte-level corpus of this machine's Python standard library sources
(:func:`dapple.cli._demo_corpus.stdlib_sources` + :func:`dapple.datasets.prepare`, read as a
:class:`dapple.datasets.TokenFile`) with bf16 autocast, AdamW (lr 3e-3, weight decay 0.1 on
``ndim >= 2`` parameters), warm-up + cosine learning rate and gradient-norm clipping at 1.

- ``dapple planned``: the plan ``dapple demo`` trains - a profile as one of 4 co-located workers
  (``profile_workload(co_workers=4)``), ``calibrate(4)``, ``make_plan(.., "dapple")`` - run by
  :func:`dapple.api.train` on the processes it uses. Step time: its ``StepMetrics.step_ms``
  (rank 0's period between the per-step collectives every rank meets).
- ``torch DDP xk``: ``DistributedDataParallel`` over the whole model (``build_model(seed)``) on
  k gloo processes - k = the planned plan's process count, and 4 (the demo's ``--nproc``) when
  that differs. The same data: :class:`dapple.datasets.BatchSource` over the same token file and
  sampler seed hands every rank step t's global batch (:class:`~dapple.datasets.EpochSampler`),
  of which rank r reads and trains its ``G / k`` rows; the same precision (forward under
  ``torch.autocast("cpu", torch.bfloat16)``, loss in fp32), optimizer
  (``torch.optim.AdamW(param_groups(..), fused=True)``), schedule (``lr_at``), clipping
  (``clip_grad_norm_(.., 1.0)``) and intra-op threads (``cores // k``, as dapple's launcher).
  Step time: each rank's period between consecutive step ends after one barrier, max over ranks.

Runners alternate within each round (the order reverses every round), so load from other jobs on
the shared cores hits all of them; tokens/s = ``G * seq`` over the median step time after the
warm-up steps of each run; dapple / DDP = the median over rounds of the paired per-round ratio.
A ``dapple demo`` run's ``summary.json`` (``--demo-summary``) adds its validation losses and
the corpus's unigram entropy to the markdown.

Usage: ``python benchmarks/train_real.py [--rounds 4 --steps 30 --skip 5 --global-batch 16 32]
[--demo-summary /tmp/demo-bench/summary.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import HERE, header, join_worker_group, load_note, run_worker_group

SEQ = 64
"""Tokens per sample (the demo's ``--seq-len``)."""
NPROC = 4
"""Local processes the plan is profiled and calibrated for (the demo's ``--nproc``)."""
OPTIONS: dict[str, Any] = {
    "optimizer": "adamw",
    "lr": 3e-3,
    "weight_decay": 0.1,
    "lr_schedule": "cosine",
    "min_lr": 3e-4,
    "clip_grad_norm": 1.0,
}
"""The demo's optimisation (``dapple.cli.demo_cmd._options``) less the warm-up, set per run."""


def _overrides() -> dict[str, Any]:
    from dapple.cli.demo_cmd import DEMO_MODEL

    return {"seq": SEQ, **DEMO_MODEL}


# -- the DDP peer -----------------------------------------------------------------------------
def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def _ddp_worker(rank: int, world: int, port: int, job: dict[str, Any], data: Any, out: str) -> None:
    """One DDP rank: ``job["steps"]`` steps on its rows of each global batch; rank 0 writes
    the per-step times (max over ranks) and global losses to ``out``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dapple.datasets import BatchSource
    from dapple.models.zoo import load_workload
    from dapple.runtime import shutdown_distributed
    from dapple.runtime.optim import lr_at, param_groups, set_lr

    join_worker_group(rank, world, port)  # as dapple's CPU ranks, for both runners
    G, steps, seed = job["G"], job["steps"], job["seed"]
    o = job["options"]
    wl = load_workload("transformer", **job["overrides"])
    model = DDP(wl.build_model(seed))
    opt = torch.optim.AdamW(
        param_groups(model.parameters(), o["weight_decay"]), lr=o["lr"], fused=True
    )
    per = G // world
    lo, hi = rank * per, (rank + 1) * per
    rows = list(range(lo, hi))
    source = BatchSource(data, G, seed, rows, rows, stop=steps)  # dapple's reader, prefetching
    ms: list[float] = []
    losses: list[float] = []
    dist.barrier()
    t = time.perf_counter()
    for step in range(steps):
        x, y = source.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[lo:hi])
        loss = wl.loss_fn(logits.float(), y[lo:hi])  # fp32, outside autocast, as dapple
        loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_grad_norm"])
        set_lr(opt, lr_at(step, lr=o["lr"], steps=steps, schedule=o["lr_schedule"],
                          warmup_steps=o["warmup_steps"], min_lr=o["min_lr"]))  # fmt: skip
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        now = time.perf_counter()
        ms.append((now - t) * 1e3)
        t = now
    source.close()
    ms = _max_over_ranks(ms)
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)  # equal rows per rank: the global mean is the mean of the ranks' means
    if rank == 0:
        Path(out).write_text(json.dumps({"ms": ms, "losses": (lt / world).tolist()}))
    del model  # DDP's reducer holds the group: drop it before the group goes
    shutdown_distributed()


def run_ddp(world: int, G: int, steps: int, data: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``steps`` DDP steps on ``world`` processes: ``{"ms": [...], "losses": [...]}``."""
    job = {"G": G, "steps": steps, "seed": 0, "options": options, "overrides": _overrides()}
    return run_worker_group(_ddp_worker, world, job, data)


def run_dapple(plan: Any, steps: int, data: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``steps`` steps of ``plan`` through :func:`dapple.api.train`: per-step ms and losses."""
    from dapple import api

    metrics = api.train(
        plan, "transformer", steps, overrides=_overrides(), data=data, precision="bf16",
        device="cpu", seed=0, **options,
    )  # fmt: skip
    return {"ms": [m.step_ms for m in metrics], "losses": [m.loss for m in metrics],
            "tokens_per_s": [m.tokens_per_s for m in metrics]}  # fmt: skip


# -- planning as ``dapple demo`` ----------------------------------------------------------------
def plan_demo(global_batches: list[int]) -> tuple[dict[int, Any], str]:
    """The demo's plans (``_plan_and_simulate``) for each global batch, and a note on them."""
    from dapple.calibrate.machine import calibrate
    from dapple.models.zoo import load_workload
    from dapple.planner import make_plan
    from dapple.profiler.measure import profile_workload

    t0 = time.perf_counter()
    wl = load_workload("transformer", **_overrides())
    profile = profile_workload(wl, [1, 2, 4, 8], device="cpu", num_threads=1, co_workers=NPROC)
    cal = calibrate(NPROC, repeats=3, sizes=(1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22))
    cl = cal.cluster
    plans = {G: make_plan(profile, cl, G, "dapple") for G in global_batches}
    note = (
        f"profile as one of {NPROC} co-workers (batch sizes 1, 2, 4, 8; CPU time), "
        f"`calibrate({NPROC})`: {cl.intra_server_bandwidth_gbps:.1f} Gbps, latency "
        f"{cl.intra_server_latency_ms:.3f} ms, c = {cl.compute_cores_per_server or 0:.2f} compute "
        f"units, host CPU {cl.action_overhead_ms:.3f} ms/action + {cl.step_overhead_ms:.2f} "
        f"ms/step; planning took {time.perf_counter() - t0:.0f} s"
    )
    return plans, note


def describe(plan: Any) -> str:
    reps = ":".join(str(s.replicas) for s in plan.stages)
    cuts = ",".join(f"{s.layers[0]}-{s.layers[1]}" for s in plan.stages)
    return (
        f"{reps} [{cuts}] M={plan.num_micro_batches} {plan.schedule} on "
        f"{len(plan.devices)} process(es), predicted L {plan.predicted_step_ms:.1f} ms"
    )


# -- the report -----------------------------------------------------------------------------
def _median_tps(ms: list[float], G: int, skip: int) -> float:
    """Tokens/s of the median step time after ``skip`` warm-up steps."""
    tail = ms[skip:] or ms
    return G * SEQ / (statistics.median(tail) / 1e3)


def _mean_tps(ms: list[float], G: int, skip: int) -> float:
    """Tokens/s over the wall time of the steps after ``skip`` (their summed periods)."""
    tail = ms[skip:] or ms
    return G * SEQ * len(tail) / (sum(tail) / 1e3)


def _paired(d: list[float], peer: list[float]) -> str:
    """``**median x** [min-max]`` of the per-round ratios ``d / peer``."""
    r = [a / b for a, b in zip(d, peer, strict=True)]
    return f"**{statistics.median(r):.2f}x** [{min(r):.2f}-{max(r):.2f}]"


def _demo_lines(path: Path) -> list[str]:
    """The markdown section of a ``dapple demo`` run's ``summary.json``."""
    s = json.loads(path.read_text())
    h = s["unigram_entropy_nats"]
    ev = {int(k): v for k, v in s["eval_losses"].items()}
    lines = [
        "",
        f"## Loss curve of `dapple demo` (`{path}`)",
        "",
        f"Plan {s['plan'].get('replication', '?')}, {len(s['losses'])} steps, global batch "
        f"{s['plan'].get('global_batch_size', '?')}; unigram byte entropy of the training "
        f"bytes **{h:.3f}** nats/byte (the loss of the best model that ignores context); first "
        f"training loss {s['losses'][0]:.3f}, last {s['losses'][-1]:.3f}.",
        "",
        "| after step | validation loss (nats/byte) | vs unigram entropy |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {k} | {v:.3f} | {v - h:+.3f} |" for k, v in sorted(ev.items())]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=30, help="steps per run")
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps dropped per run")
    ap.add_argument("--global-batch", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--corpus-mib", type=float, default=2.0, help="MiB of stdlib sources")
    ap.add_argument("--demo-summary", type=Path, help="summary.json of a `dapple demo` run")
    ap.add_argument("--out", default=str(HERE / "train_real.md"))
    ap.add_argument("--raw", type=Path, help="also write every run's step times and losses here")
    args = ap.parse_args(argv)
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python benchmarks/train_real.py {args_text}".strip()
    lines = header("Training on real data: dapple's planned plan vs DDP (CPU, gloo)", command)
    t_start = time.perf_counter()
    from dapple.cli._demo_corpus import stdlib_sources
    from dapple.datasets import TokenFile, prepare

    options = {**OPTIONS, "warmup_steps": max(1, args.steps // 10)}
    with tempfile.TemporaryDirectory() as tmp:
        prep = prepare(stdlib_sources(int(args.corpus_mib * 2**20)), Path(tmp) / "train.bin",
                       val_fraction=0.05)  # fmt: skip
        data = TokenFile(prep.train, SEQ)
        plans, plan_note = plan_demo(args.global_batch)
        print(f"planned ({plan_note}):", flush=True)
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for G, plan in plans.items():
            print(f"  G = {G}: {describe(plan)}", flush=True)
            worlds = list(dict.fromkeys([len(plan.devices), NPROC]))
            names = ["dapple planned"] + [f"torch DDP x{w}" for w in worlds]
            for rnd in range(args.rounds):
                order = names if rnd % 2 == 0 else names[::-1]
                for name in order:
                    if name == "dapple planned":
                        got = run_dapple(plan, args.steps, data, options)
                    else:
                        got = run_ddp(int(name.rsplit("x", 1)[1]), G, args.steps, data, options)
                    got["load1"] = os.getloadavg()[0]
                    runs.setdefault((G, name), []).append(got)
                    print(
                        f"  G={G} round {rnd} {name:16s} "
                        f"{_median_tps(got['ms'], G, args.skip):9.0f} tokens/s  ({load_note()})",
                        flush=True,
                    )
    elapsed = time.perf_counter() - t_start
    loads = [r["load1"] for rs in runs.values() for r in rs]
    lines += [
        f"Job: `dapple demo`'s - zoo `transformer` {_overrides()} on {prep.train_tokens:,} "
        f"training bytes of {args.corpus_mib:g} MiB of standard library sources (byte-level, "
        f"vocabulary 256), bf16 autocast, AdamW lr {OPTIONS['lr']} weight decay "
        f"{OPTIONS['weight_decay']} (ndim >= 2), warm-up {options['warmup_steps']} steps + "
        f"cosine to {OPTIONS['min_lr']}, clipping at {OPTIONS['clip_grad_norm']}; sampler seed "
        f"and initial weights seed 0. Planned as `dapple demo` does: {plan_note}.",
        "",
        f"Each run trains {args.steps} steps from step 0 in fresh processes; tokens/s = G x "
        f"{SEQ} over the median step time of steps {args.skip}..{args.steps - 1}. "
        f"{args.rounds} rounds, runners alternating (order reversed every round). dapple: "
        "`StepMetrics.step_ms` (rank 0, between the per-step collectives every rank meets); "
        "DDP: each rank's period between step ends after one barrier, max over ranks. "
        "dapple / DDP = median over rounds of the paired per-round ratio [range]; the "
        "wall-time column divides the same steps' tokens by their summed step times instead. "
        "Both runners' processes keep freed memory for the next step "
        "(`dapple.host.host_memory.keep_freed_memory`, which dapple's CPU ranks call; the "
        "DDP workers call it too).",
        "",
        "| G | runner | tokens/s per round (median step) | median over rounds "
        "| step ms [min-max] | dapple / runner [range] | same, wall-time tokens/s [range] "
        "| max loss diff |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    summary: list[str] = []
    for G, plan in plans.items():
        d = runs[(G, "dapple planned")]
        d_med = [_median_tps(r["ms"], G, args.skip) for r in d]
        d_wall = [_mean_tps(r["ms"], G, args.skip) for r in d]
        for (g, name), rs in runs.items():
            if g != G:
                continue
            tps = [_median_tps(r["ms"], G, args.skip) for r in rs]
            label = f"dapple planned: {describe(plan)}" if name == "dapple planned" else name
            ratio = wall = diff = ""
            if name != "dapple planned":
                ratio = _paired(d_med, tps)
                wall = _paired(d_wall, [_mean_tps(r["ms"], G, args.skip) for r in rs])
                dl = max(
                    abs(a - b)
                    for x, y in zip(d, rs, strict=True)
                    for a, b in zip(x["losses"], y["losses"], strict=True)
                )
                diff = f"{dl:.1e}"
                summary.append(f"G = {G}, dapple / {name}: {ratio} (wall time: {wall})")
            per = ", ".join(f"{v:,.0f}" for v in tps)
            steps = [v for r in rs for v in r["ms"][args.skip :]]
            lines.append(
                f"| {G} | {label} | {per} | {statistics.median(tps):,.0f} "
                f"| {min(steps):.0f}-{max(steps):.0f} | {ratio} | {wall} | {diff} |"
            )
    lines += [
        "",
        "Step ms: the fastest and slowest step after warm-up over all rounds. "
        "Max loss diff: the largest |dapple loss - DDP loss| over every step of every round "
        "(same batches and initial weights; bf16 rounding and reduction order differ).",
        "",
        "Ratios (median-step tokens/s; wall time over the same steps in parentheses): "
        + "; ".join(summary)
        + ".",
        "",
        f"1-min load average after each run: {min(loads):.2f}-{max(loads):.2f}. End: "
        f"{load_note()}; the script took {elapsed:.0f} s.",
    ]
    if args.demo_summary is not None:
        lines += _demo_lines(args.demo_summary)
    if args.raw is not None:
        raw = [{"G": g, "runner": n, "rounds": rs} for (g, n), rs in runs.items()]
        args.raw.write_text(json.dumps(raw, indent=1) + "\n")
    lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
