"""``dapple demo``: a real training job on one CPU machine, end to end.

1. Prepare a byte-level corpus from this machine's Python standard library sources (no
   download) and compute its unigram byte entropy - the loss to beat.
2. Profile a small GPT as one of ``--nproc`` workers sharing the cores, measure the local links
   (``calibrate``), plan it with DAPPLE beside the baselines, simulate the chosen plan (Gantt,
   memory, Perfetto trace).
3. Train the chosen plan on the corpus across the local gloo processes: AdamW, warm-up + cosine
   learning rate, global gradient-norm clipping, validation every quarter of the run, a
   checkpoint at the end; print predicted vs measured step time, the loss curve and validation
   loss against the entropy.
4. Greedily generate a continuation from the trained weights.
5. Train the same model under an uneven 3:1 plan on the same batches (its losses match the
   chosen plan's) and ``verify`` it against one process.

Everything is written under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dapple.cli._model_args import add_model_argument

__all__ = ["DEMO_MODEL", "register"]

DEMO_MODEL = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256}
"""The default model's sizes (``-m transformer``): a byte-level GPT of about 0.8M parameters."""
PROMPT = "def __init__(self"
LOSS_GAP_RTOL = 1e-3
"""Two plans over the same batches at the same lr: their losses may drift apart by rounding
(Adam turns rounding of tiny gradients into lr-sized steps), never by a sizeable fraction."""
"""What the trained model continues."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="prepare a corpus, plan and train a small GPT on it on 4 CPU processes, "
        "generate, verify an uneven plan",
    )
    p.add_argument("--out-dir", default="out/demo", help="output directory (default out/demo)")
    p.add_argument("--nproc", type=int, default=4, help="local processes / devices (default 4)")
    p.add_argument("--steps", type=int, default=240, help="training steps (default 240)")
    p.add_argument(
        "--global-batch-size", type=int, default=16, help="samples per step (default 16)"
    )
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sample (default 64)")
    p.add_argument(
        "--corpus-mib",
        type=float,
        default=2.0,
        help="MiB of standard library sources to train on (default 2)",
    )
    add_model_argument(p, default="transformer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from dapple.cli._demo_corpus import nats_to_bits, stdlib_sources, unigram_entropy
    from dapple.datasets import TokenFile, prepare

    con = Console()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overrides: dict[str, Any] = {"seq": args.seq_len}
    if args.model == "transformer":
        overrides |= DEMO_MODEL

    con.rule("1. data: Python standard library sources as bytes")
    sources = stdlib_sources(int(args.corpus_mib * 2**20))
    prep = prepare(sources, out / "data" / "train.bin", val_fraction=0.05)
    train_data, val_data = TokenFile(prep.train, args.seq_len), TokenFile(prep.val, args.seq_len)
    entropy = unigram_entropy(np.fromfile(prep.train, dtype=prep.dtype), prep.vocab_size)
    con.print(
        f"{len(sources)} files ({sources[0].name} .. {sources[-1].name}): "
        f"{prep.train_tokens:,} training and {prep.val_tokens:,} validation bytes -> {prep.train}"
    )
    con.print(
        f"unigram byte entropy {entropy:.3f} nats ({nats_to_bits(entropy):.2f} bits) per byte: "
        "the loss of the best model that ignores context"
    )

    plan, sim = _plan_and_simulate(con, args, out, overrides)
    metrics = _train(con, args, out, plan, sim.step_ms, overrides, train_data, val_data, entropy)
    _generate(con, args, out, overrides)
    failed = _uneven(con, args, plan, overrides, train_data, metrics)
    final = [m.eval_loss for m in metrics if m.eval_loss is not None][-1]
    if final >= entropy:
        failed.append(f"validation loss {final:.3f} not below the unigram entropy {entropy:.3f}")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "plan": plan.to_dict(),
                "model": args.model,
                "overrides": overrides,
                "unigram_entropy_nats": entropy,
                "simulated_step_ms": sim.step_ms,
                "losses": [m.loss for m in metrics],
                "eval_losses": {m.step: m.eval_loss for m in metrics if m.eval_loss is not None},
            },
            indent=2,
        )
        + "\n"
    )
    for f in failed:
        con.print(f"[red]check failed:[/red] {f}")
    if failed:
        con.print(f"[red]demo: {len(failed)} check(s) failed[/red]")
        return 1
    con.print("[green]demo: every check passed[/green]")
    return 0


def _plan_and_simulate(
    con: Console, args: argparse.Namespace, out: Path, overrides: dict[str, Any]
) -> tuple[Any, Any]:
    """Profile, calibrate, plan (DAPPLE and the baselines) and simulate the chosen plan."""
    from dapple.calibrate.machine import calibrate
    from dapple.models.zoo import load_workload
    from dapple.planner import make_plan
    from dapple.profiler.measure import profile_workload
    from dapple.simulate import simulate
    from dapple.simulate.plots import plot_gantt, plot_memory
    from dapple.simulate.trace import write_trace

    wl = load_workload(args.model, **overrides)
    con.rule(
        f"2. profile {wl.name} ({wl.num_layers} layers) on cpu, as one of {args.nproc} workers"
    )
    batch_sizes = [1, 2, 4, 8]
    with Progress(console=con, transient=True) as bar:
        task = bar.add_task("profiling", total=wl.num_layers * len(batch_sizes))
        profile = profile_workload(
            wl,
            batch_sizes,
            device="cpu",
            num_threads=1,
            co_workers=args.nproc,  # CPU time while the other workers train: they share cores
            progress=lambda done, total, _label: bar.update(task, completed=done, total=total),
        )
    profile.save(out / "profile.json")
    con.print(
        f"{profile.num_layers} layers, {profile.parameter_bytes / 2**20:.2f} MiB of parameters "
        f"-> {out / 'profile.json'}"
    )
    with con.status(f"measuring the links and compute share of {args.nproc} gloo processes..."):
        cal = calibrate(args.nproc, repeats=3, sizes=(1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22))
    cluster = cal.cluster
    cluster.save(out / "cluster.json")
    con.print(
        f"calibrated: {cluster.intra_server_bandwidth_gbps:.1f} Gbps, latency "
        f"{cluster.intra_server_latency_ms:.3f} ms, compute slowdown "
        f"{cluster.compute_slowdown:.2f} -> {out / 'cluster.json'}"
    )
    G = args.global_batch_size
    plans = {}
    for name in ("dapple", "dp", "straight", "gpipe", "pipedream"):
        try:
            plans[name] = make_plan(profile, cluster, G, name)
        except Exception as e:  # a baseline may be infeasible; show why
            con.print(f"[yellow]{name}: {e}[/yellow]")
    t = Table(title=f"planners under the same cost model, global batch {G}")
    for col in ("planner", "stages", "replication", "M", "schedule", "predicted L ms", "vs dp"):
        t.add_column(col, justify="right")
    dp_ms = plans["dp"].predicted_step_ms if "dp" in plans else float("nan")
    for name, p in plans.items():
        t.add_row(name, str(p.num_stages), p.replication, str(p.num_micro_batches),
                  f"{p.schedule}/{p.policy}", f"{p.predicted_step_ms:.2f}",
                  f"{dp_ms / p.predicted_step_ms:.2f}x")  # fmt: skip
    con.print(t)
    plan = plans["dapple"]
    plan.save(out / "plan.json")
    sim = simulate(plan, profile, cluster)
    other = dataclasses.replace(plan, schedule="gpipe" if plan.schedule == "dapple" else "dapple")
    runs = sorted(
        [(f"{plan.schedule} (chosen)", sim), (other.schedule, simulate(other, profile, cluster))],
        key=lambda r: r[1].schedule != "gpipe",
    )
    plot_gantt(runs, out / "gantt.png")
    plot_memory(runs, out / "memory.png")
    write_trace(sim, out / "trace.json")
    con.print(
        f"chosen: {plan.replication} split at {list(plan.split_positions)}, "
        f"M={plan.num_micro_batches} -> {out / 'plan.json'}; simulated step {sim.step_ms:.2f} ms; "
        f"{out / 'gantt.png'}, {out / 'memory.png'}, {out / 'trace.json'} (ui.perfetto.dev)"
    )
    return plan, sim


def _options(steps: int) -> dict[str, Any]:
    """The optimisation of every demo run: AdamW, warm-up + cosine, clipping at 1."""
    return {
        "optimizer": "adamw",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "lr_schedule": "cosine",
        "warmup_steps": max(1, steps // 10),
        "min_lr": 3e-4,
        "clip_grad_norm": 1.0,
    }


def _train(
    con: Console,
    args: argparse.Namespace,
    out: Path,
    plan: Any,
    simulated_ms: float,
    overrides: dict[str, Any],
    train_data: Any,
    val_data: Any,
    entropy: float,
) -> list[Any]:
    """Train the chosen plan on the corpus; report time, losses and validation loss."""
    from dapple import api
    from dapple.runtime.reporting import write_loss_curve

    steps = args.steps
    con.rule(f"3. train {plan.replication} for {steps} steps on {len(plan.devices)} processes")
    ckpt = out / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)  # the demo's own checkpoints of an earlier run
    eval_batches = max(1, min(4, len(val_data) // plan.global_batch_size))
    metrics = api.train(
        plan, args.model, steps, overrides=overrides, data=train_data, eval_data=val_data,
        eval_every=max(1, steps // 4), eval_batches=eval_batches, progress=True,
        predicted_step_ms=simulated_ms, metrics_path=str(out / "metrics.jsonl"),
        checkpoint_dir=str(ckpt), save_every=steps, keep=1, **_options(steps),
    )  # fmt: skip
    measured = statistics.median(m.step_ms for m in metrics[min(3, len(metrics) - 1) :])
    t = Table(title="training: every validation")
    for col in ("step", "train loss", "validation loss", "lr", "grad norm", "tokens/s"):
        t.add_column(col, justify="right")
    for m in metrics:
        if m.eval_loss is not None:
            t.add_row(str(m.step), f"{m.loss:.3f}", f"{m.eval_loss:.3f}", f"{m.lr:.2e}",
                      f"{m.grad_norm:.2f}", f"{m.tokens_per_s or 0:,.0f}")  # fmt: skip
    con.print(t)
    con.print(
        f"step time: planner L {plan.predicted_step_ms:.1f} ms, simulator {simulated_ms:.1f} ms, "
        f"measured {measured:.1f} ms (median after 3 steps)"
    )
    final = [m.eval_loss for m in metrics if m.eval_loss is not None][-1]
    verdict = "[green]below[/green]" if final < entropy else "[red]NOT below[/red]"
    con.print(
        f"validation loss {final:.3f} nats/byte is {verdict} the unigram entropy {entropy:.3f} "
        f"({entropy - final:+.3f}); loss curve {write_loss_curve(metrics, out / 'loss.png')}"
    )
    return metrics


def _generate(con: Console, args: argparse.Namespace, out: Path, overrides: dict[str, Any]) -> None:
    """Greedy continuation of :data:`PROMPT` from the run's last checkpoint."""
    import torch

    from dapple.models.generate import greedy_generate
    from dapple.models.zoo import load_workload
    from dapple.runtime.checkpoint import restore_stage
    from dapple.runtime.checkpoint_files import latest_checkpoint

    con.rule("4. generate from the trained weights (greedy)")
    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is None:  # pragma: no cover - the run saves at its last step
        con.print("[yellow]no checkpoint to generate from[/yellow]")
        return
    model = load_workload(args.model, **overrides).build_model(0)
    restore_stage(ckpt, model, 0)
    prompt = torch.tensor(list(PROMPT.encode()), dtype=torch.long)
    ids = greedy_generate(model, prompt, new_tokens=160, context=args.seq_len)
    text = bytes(int(i) for i in ids).decode("utf-8", errors="replace")
    con.print(f"checkpoint step {ckpt.step}, prompt {PROMPT!r}:")
    con.print(text, markup=False, highlight=False)


def _uneven(
    con: Console,
    args: argparse.Namespace,
    plan: Any,
    overrides: dict[str, Any],
    train_data: Any,
    metrics: list[Any],
) -> list[str]:
    """The same model under a 3:1 plan: same batches, same losses; ``verify`` against one
    process. Returns the checks that failed."""
    from dapple import api
    from dapple.cli.verify_cmd import print_report
    from dapple.core.plan import straight_plan

    n = _num_layers(args.model, overrides)
    G = plan.global_batch_size
    uneven = straight_plan(n, [0, n - 2], global_batch_size=G, num_micro_batches=max(1, G // 4),
                           replicas=[3, 1])  # fmt: skip
    # within the warm-up the lr does not depend on the run's length: the same lr as the
    # chosen plan's run at every step, so the losses must agree up to float rounding
    steps = min(20, _options(args.steps)["warmup_steps"], args.steps)
    con.rule(f"5. the same model under 3:1 (layers {uneven.stages[0].layers} x 3, "
             f"{uneven.stages[1].layers} x 1): {steps} steps, then verify")  # fmt: skip
    mine = api.train(uneven, args.model, steps, overrides=overrides, data=train_data,
                     **_options(args.steps))  # fmt: skip
    gap = max(abs(a.loss - b.loss) for a, b in zip(mine, metrics, strict=False))
    con.print(
        f"3:1 losses {mine[0].loss:.4f} .. {mine[-1].loss:.4f}; largest difference from the "
        f"{plan.replication} run over the same {steps} steps (same batches, same lr): {gap:.2e}"
    )
    report = api.verify(uneven, args.model, 3, overrides=overrides, data=train_data,
                        device="cpu", **_options(args.steps))  # fmt: skip
    print_report(con, report)
    failed = []
    if gap > LOSS_GAP_RTOL * abs(metrics[0].loss):
        failed.append(f"3:1 losses differ from the {plan.replication} run's by {gap:.2e}")
    if not report.ok:
        failed += [f"verify of 3:1: {f}" for f in report.failures or ["MISMATCH"]]
    return failed


def _num_layers(model: str, overrides: dict[str, Any]) -> int:
    """The number of chain layers of the demo model."""
    from dapple.models.zoo import load_workload

    return load_workload(model, **overrides).num_layers
