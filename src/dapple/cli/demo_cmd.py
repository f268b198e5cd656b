"""``dapple demo``: a real training job on one CPU machine, end to end.

1. Prepare a byte-level corpus from this machine's Python standard library sources (no
   download) and compute its unigram byte entropy - the loss to beat.
2. Profile a small GPT as one of ``--nproc`` workers sharing the cores, measure the local links
   and how the processes share the cores (``calibrate``), plan it with DAPPLE beside the
   baselines and say why the planner chose what it chose (predicted step of the candidates,
   memory, what limited it). The demo trains a pipeline with *uneven* replication over all
   ``--nproc`` processes whatever the machine: the planner's choice when it is one, else the
   best such plan under the same cost model (:mod:`dapple.planner.uneven`; on a loaded
   machine the planner may well choose one process). Simulate it (Gantt, memory, Perfetto).
3. Train that plan on the corpus across the local gloo processes: AdamW, warm-up + cosine
   learning rate, global gradient-norm clipping, validation every quarter of the run, a
   checkpoint at the end; print predicted vs measured step time, the loss curve and validation
   loss against the entropy.
4. Generate a continuation from the trained weights (sampled; the greedy one beside it).
5. Run the planner's choice (if another plan) on the same batches over the warm-up (its losses
   match), and ``verify`` the uneven pipeline against one process.

Off a terminal every long phase prints plain progress lines (:class:`StepProgress`). Everything
is written under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from dapple.cli._console import StepProgress, console, format_seconds, print_table
from dapple.cli._demo_args import DemoConfig
from dapple.cli._demo_generate import generate_step
from dapple.cli._demo_run import median_step_ms, one_thread, run_progress
from dapple.cli._model_args import add_model_argument

if TYPE_CHECKING:
    from dapple.cli._demo_plan import Costed

__all__ = ["DEMO_MODEL", "demo_config_of", "register", "run_config"]

DEMO_MODEL = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256}
"""The default model's sizes (``-m transformer``): a byte-level GPT of about 0.8M parameters."""
LOSS_GAP_RTOL = 1e-3
"""Two plans over the same batches at the same lr: their losses may drift apart by rounding
(Adam turns rounding of tiny gradients into lr-sized steps), never by a sizeable fraction."""
CHOICE_STEPS = 4
"""Steps the planner's choice runs beside the trained pipeline (step 5): enough to compare the
losses and measure a step, short enough for a loaded machine."""
VERIFY_STEPS = 2
"""Steps ``verify`` compares the trained pipeline against one process."""
BASELINES = ("dp", "straight", "gpipe", "pipedream")
"""The planners shown beside DAPPLE under the same cost model."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Planned:
    """What step 2 decided: the planner's choice, the plan trained, and its simulation."""

    choice: Costed
    """The planner's plan."""
    trained: Costed
    """The uneven pipeline trained (``choice`` itself when it is one)."""
    sim: Any
    """The simulation of ``trained.plan``."""
    why: list[str]
    """The lines that say why the planner chose ``choice``."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="prepare a corpus, plan a small GPT for 4 CPU processes, train an uneven pipeline "
        "on it, generate, verify it",
    )
    p.add_argument("--out-dir", default="out/demo", help="output directory (default out/demo)")
    p.add_argument(
        "--nproc", type=int, default=4, help="local processes / devices, at least 3 (default 4)"
    )
    p.add_argument("--steps", type=int, default=240, help="training steps (default 240)")
    p.add_argument(
        "--global-batch-size", type=int, default=16, help="samples per step (default 16)"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=64,
        metavar="N",
        help="tokens per sample, as for dapple train (the model is built with seq=N; the demo's "
        "tokens are bytes; default 64)",
    )
    p.add_argument(
        "--corpus-mib",
        type=float,
        default=2.0,
        help="MiB of standard library sources to train on (default 2)",
    )
    add_model_argument(p, default="transformer")
    p.set_defaults(func=run)


def demo_config_of(args: argparse.Namespace) -> DemoConfig:
    """The :class:`~dapple.cli._demo_args.DemoConfig` of ``dapple demo``'s flags."""
    return DemoConfig(
        out_dir=args.out_dir,
        nproc=args.nproc,
        steps=args.steps,
        global_batch_size=args.global_batch_size,
        seq_len=args.seq_len,
        corpus_mib=args.corpus_mib,
        model=args.model,
    )


def run(args: argparse.Namespace) -> int:
    return run_config(demo_config_of(args))


def run_config(cfg: DemoConfig) -> int:
    """Run the demo ``cfg`` asks for (``dapple demo`` once its flags are read)."""
    import numpy as np

    from dapple.cli._demo_args import DEMO_MARKER, check_demo_args
    from dapple.cli._demo_corpus import nats_to_bits, stdlib_sources, unigram_entropy
    from dapple.datasets import TokenFile, prepare

    out = check_demo_args(cfg)
    started = time.monotonic()
    con = console()
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).touch()  # the directory is the demo's: a later run may replace it
    overrides: dict[str, Any] = {"seq": cfg.seq_len}
    if cfg.model == "transformer":
        overrides |= DEMO_MODEL

    con.rule("1. data: Python standard library sources as bytes")
    sources = stdlib_sources(int(cfg.corpus_mib * 2**20))
    prep = prepare(sources, out / "data" / "train.bin", val_fraction=0.05)
    train_data, val_data = TokenFile(prep.train, cfg.seq_len), TokenFile(prep.val, cfg.seq_len)
    entropy = unigram_entropy(np.fromfile(prep.train, dtype=prep.dtype), prep.vocab_size)
    con.print(
        f"{len(sources)} files ({sources[0].name} .. {sources[-1].name}): "
        f"{prep.train_tokens:,} training and {prep.val_tokens:,} validation bytes -> {prep.train}"
    )
    con.print(
        f"unigram byte entropy {entropy:.3f} nats ({nats_to_bits(entropy):.2f} bits) per byte: "
        "the loss of the best model that ignores context"
    )

    planned = _plan_and_simulate(con, cfg, out, overrides)
    plan = planned.trained.plan
    sim_ms = planned.sim.step_ms
    metrics = _train(con, cfg, out, plan, sim_ms, overrides, train_data, val_data, entropy)
    generate_step(con, cfg.model, out, overrides, cfg.seq_len)
    failed = _compare_and_verify(con, cfg, out, planned, overrides, train_data, metrics)
    final = [m.eval_loss for m in metrics if m.eval_loss is not None][-1]
    if final >= entropy:
        failed.append(f"validation loss {final:.3f} not below the unigram entropy {entropy:.3f}")
    wall_s = time.monotonic() - started
    (out / "summary.json").write_text(
        json.dumps(
            {
                "plan": plan.to_dict(),
                "planner_choice": planned.choice.plan.to_dict(),
                "why": planned.why,
                "model": cfg.model,
                "overrides": overrides,
                "unigram_entropy_nats": entropy,
                "simulated_step_ms": planned.sim.step_ms,
                "losses": [m.loss for m in metrics],
                "eval_losses": {m.step: m.eval_loss for m in metrics if m.eval_loss is not None},
                "wall_s": wall_s,
            },
            indent=2,
        )
        + "\n"
    )
    return _close(con, failed, wall_s)


def _close(con: Console, failed: list[str], wall_s: float) -> int:
    """The demo's last lines and its exit code: each failed check on stdout and, when any
    failed, one ``dapple: error:`` line on stderr naming them, exit code 1; else 0."""
    for f in failed:
        con.print(f"[red]check failed:[/red] {f}")
    if failed:
        con.print(f"[red]demo: {len(failed)} check(s) failed[/red] ({format_seconds(wall_s)})")
        con.file.flush()
        print(f"dapple: error: demo: {len(failed)} check(s) failed: {'; '.join(failed)}",
              file=sys.stderr)  # fmt: skip
        return 1
    con.print(f"[green]demo: every check passed[/green] in {format_seconds(wall_s)}")
    return 0


def _plan_and_simulate(
    con: Console, cfg: DemoConfig, out: Path, overrides: dict[str, Any]
) -> _Planned:
    """Profile, calibrate, plan (DAPPLE, the baselines and the best uneven pipeline), say why,
    and simulate the plan to train."""
    profile, cluster = _profile_and_calibrate(con, cfg, out, overrides)
    choice, trained, why = _plan(con, cfg, out, profile, cluster)
    sim = _simulate(con, out, trained.plan, profile, cluster)
    return _Planned(choice=choice, trained=trained, sim=sim, why=why)


def _profile_and_calibrate(
    con: Console, cfg: DemoConfig, out: Path, overrides: dict[str, Any]
) -> tuple[Any, Any]:
    """The model's profile as one of ``--nproc`` workers, and the calibrated local cluster."""
    from dapple.calibrate.machine import calibrate
    from dapple.models.zoo import load_workload
    from dapple.profiler.host_fit import check_host_memory
    from dapple.profiler.measure import profile_workload

    wl = load_workload(cfg.model, **overrides)
    check_host_memory(wl, cfg.nproc)  # before any layer is built
    con.rule(f"2. profile, calibrate and plan for {cfg.nproc} processes")
    con.print(f"{wl.name}: {wl.num_layers} layers, profiled on cpu as one of {cfg.nproc} workers")
    batch_sizes = [1, 2, 4, 8]
    total = wl.num_layers * len(batch_sizes)
    with StepProgress(f"profile {wl.name}", total, console=con) as progress:
        profile = profile_workload(
            wl,
            batch_sizes,
            device="cpu",
            num_threads=1,
            co_workers=cfg.nproc,  # CPU time while the other workers train: they share cores
            progress=progress,
        )
    profile.save(out / "profile.json")
    con.print(
        f"{profile.num_layers} layers, {profile.parameter_bytes / 2**20:.2f} MiB of parameters "
        f"-> {out / 'profile.json'}"
    )
    detail = f"measuring the links and the core share of {cfg.nproc} gloo processes"
    with StepProgress("calibrate", detail=detail, console=con):
        cal = calibrate(cfg.nproc, repeats=3, sizes=(1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22))
    cluster = cal.cluster
    cluster.save(out / "cluster.json")
    c = cluster.compute_cores_per_server
    share = (
        f"the {cfg.nproc} processes share {c:.2f} full-speed workers' worth of cores "
        f"(background load {cluster.background_load_per_server:.2f})"
        if c is not None
        else f"compute slowdown {cluster.compute_slowdown:.2f}"
    )
    con.print(
        f"calibrated: {cluster.intra_server_bandwidth_gbps:.1f} Gbps, latency "
        f"{cluster.intra_server_latency_ms:.3f} ms; {share} -> {out / 'cluster.json'}"
    )
    return profile, cluster


def _plan(
    con: Console, cfg: DemoConfig, out: Path, profile: Any, cluster: Any
) -> tuple[Costed, Costed, list[str]]:
    """DAPPLE's plan, the baselines and the best uneven pipeline, in one table; why the planner
    chose its plan; which plan the demo trains. Returns the choice, the plan to train (both
    :class:`~dapple.cli._demo_plan.Costed`) and the lines of why."""
    from dapple.cli._demo_plan import cost, why
    from dapple.planner import make_plan
    from dapple.planner.uneven import is_uneven_pipeline, uneven_pipeline

    G = cfg.global_batch_size
    costed = {"dapple": cost("dapple", make_plan(profile, cluster, G, "dapple"), profile, cluster)}
    for name in BASELINES:
        try:
            costed[name] = cost(name, make_plan(profile, cluster, G, name), profile, cluster)
        except Exception as e:  # a baseline may be infeasible; show why
            con.print(f"[yellow]{name}: {e}[/yellow]")
    choice = trained = costed["dapple"]
    if not is_uneven_pipeline(choice.plan, cfg.nproc):
        uneven = uneven_pipeline(profile, cluster, G)
        trained = costed["uneven"] = cost("uneven", uneven, profile, cluster)
    _print_candidates(con, cfg, costed, trained)
    reasons = why(choice, trained, [costed[n] for n in BASELINES if n in costed], cluster)
    for line in reasons:
        con.print(line, markup=False, highlight=False)
    choice.plan.save(out / "plan-dapple.json")
    trained.plan.save(out / "plan.json")
    if trained is choice:
        con.print(
            f"trained: dapple's choice {choice.label}, itself a pipeline with uneven replication"
        )
    else:
        con.print(
            f"trained: {trained.label}, the best plan with uneven replication over all "
            f"{cfg.nproc} processes ({trained.step_ms / choice.step_ms:.2f}x dapple's predicted "
            f"step): what only dapple runs; dapple's choice {choice.label} "
            f"({out / 'plan-dapple.json'}) runs its {_first(_choice_steps(cfg.steps))} on the "
            "same batches in step 5"
        )
    return choice, trained, reasons


def _print_candidates(
    con: Console, cfg: DemoConfig, costed: dict[str, Costed], trained: Costed
) -> None:
    """One row per planner (and the trained uneven pipeline): L, memory, against DP."""
    t = Table(
        title=f"planners under the same cost model, global batch {cfg.global_batch_size}, "
        f"{cfg.nproc} processes"
    )
    for col in ("planner", "processes", "stages", "replication", "M", "schedule",
                "predicted L ms", "vs dp", "peak MiB"):  # fmt: skip
        t.add_column(col, justify="right")
    dp_ms = costed["dp"].step_ms if "dp" in costed else float("nan")
    for name, c in costed.items():
        p = c.plan
        mark = " (trained)" if c is trained else ""
        t.add_row(f"{name}{mark}", str(len(p.devices)), str(p.num_stages), p.replication,
                  str(p.num_micro_batches), f"{p.schedule}/{p.policy}", f"{c.step_ms:.2f}",
                  f"{dp_ms / c.step_ms:.2f}x", f"{c.peak_bytes / 2**20:.1f}")  # fmt: skip
    print_table(con, t)


def _simulate(con: Console, out: Path, plan: Any, profile: Any, cluster: Any) -> Any:
    """Simulate ``plan`` beside its other schedule: Gantt, memory, Perfetto trace."""
    from dapple.simulate import simulate
    from dapple.simulate.plan_variants import baseline_first, compared_plan
    from dapple.simulate.plots import plot_gantt, plot_memory
    from dapple.simulate.trace import write_trace

    sim = simulate(plan, profile, cluster)
    other = compared_plan(plan)
    runs = baseline_first(
        [(f"{plan.schedule} (trained)", sim), (other.schedule, simulate(other, profile, cluster))]
    )
    plot_gantt(runs, out / "gantt.png")
    plot_memory(runs, out / "memory.png")
    write_trace(sim, out / "trace.json")
    con.print(
        f"{plan.replication} layers {[list(st.layers) for st in plan.stages]}, "
        f"M={plan.num_micro_batches} -> {out / 'plan.json'}; simulated step {sim.step_ms:.2f} ms; "
        f"{out / 'gantt.png'}, {out / 'memory.png'}, {out / 'trace.json'} (ui.perfetto.dev)"
    )
    return sim


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


def _first(steps: int) -> str:
    """``first 4 steps``, ``first step``."""
    return f"first {steps} steps" if steps > 1 else "first step"


def _choice_steps(steps: int) -> int:
    """Steps of the planner's choice in step 5: :data:`CHOICE_STEPS`, within the warm-up. There
    the lr does not depend on the run's length: the same lr as the trained run at every step, so
    the losses must agree up to float rounding."""
    return min(CHOICE_STEPS, int(_options(steps)["warmup_steps"]), steps)


def _train(
    con: Console,
    cfg: DemoConfig,
    out: Path,
    plan: Any,
    simulated_ms: float,
    overrides: dict[str, Any],
    train_data: Any,
    val_data: Any,
    entropy: float,
) -> list[Any]:
    """Train ``plan`` on the corpus; report time, losses and validation loss."""
    from dapple import api
    from dapple.runtime.checkpoint import delete_checkpoints
    from dapple.runtime.reporting import write_loss_curve

    steps = cfg.steps
    con.rule(f"3. train {plan.replication} for {steps} steps on {len(plan.devices)} processes")
    ckpt = out / "checkpoints"
    delete_checkpoints(ckpt)  # an earlier run's (only what a save writes: check_demo_args)
    eval_batches = max(1, min(4, len(val_data) // plan.global_batch_size))
    with run_progress(con, f"train {plan.replication}", steps, out / "metrics.jsonl"):
        metrics = api.train(
            plan, cfg.model, steps, overrides=overrides, data=train_data, eval_data=val_data,
            eval_every=max(1, steps // 4), eval_batches=eval_batches,
            predicted_step_ms=simulated_ms, metrics_path=str(out / "metrics.jsonl"),
            checkpoint_dir=str(ckpt), save_every=steps, keep=1, **_options(steps),
        )  # fmt: skip
    measured = median_step_ms(metrics, 3)
    t = Table(title="training: every validation")
    for col in ("step", "train loss", "validation loss", "lr", "grad norm", "tokens/s"):
        t.add_column(col, justify="right")
    for m in metrics:
        if m.eval_loss is not None:
            t.add_row(str(m.step), f"{m.loss:.3f}", f"{m.eval_loss:.3f}", f"{m.lr:.2e}",
                      f"{m.grad_norm:.2f}", f"{m.tokens_per_s or 0:,.0f}")  # fmt: skip
    print_table(con, t)
    con.print(
        f"step time: planner L {plan.predicted_step_ms:.1f} ms, simulator {simulated_ms:.1f} ms, "
        f"measured {measured:.1f} ms (median after 3 steps)"
    )
    from dapple.cli._prediction_note import prediction_basis

    basis = prediction_basis(str(out / "profile.json"), str(out / "cluster.json"), measured,
                             simulated_ms)  # fmt: skip
    con.print(basis, markup=False, highlight=False)
    final = [m.eval_loss for m in metrics if m.eval_loss is not None][-1]
    verdict = "[green]below[/green]" if final < entropy else "[red]NOT below[/red]"
    con.print(
        f"validation loss {final:.3f} nats/byte is {verdict} the unigram entropy {entropy:.3f} "
        f"({entropy - final:+.3f}); loss curve {write_loss_curve(metrics, out / 'loss.png')}"
    )
    return metrics


def _compare_and_verify(
    con: Console,
    cfg: DemoConfig,
    out: Path,
    planned: _Planned,
    overrides: dict[str, Any],
    train_data: Any,
    metrics: list[Any],
) -> list[str]:
    """The planner's choice for a few steps on the same batches (same losses as the trained
    pipeline; its measured step beside the predicted one), then ``verify`` of the trained
    pipeline against one process. Returns the checks that failed."""
    from dapple import api
    from dapple.cli.verify_cmd import print_report

    plan = planned.trained.plan
    failed: list[str] = []
    if planned.trained is planned.choice:
        con.rule(f"5. verify {plan.replication} against one process")
    else:
        con.rule(f"5. dapple's choice on the same batches; verify {plan.replication}")
        failed += _run_choice(con, cfg, out, planned, overrides, train_data, metrics)
    detail = "against one process"
    with StepProgress(f"verify {plan.replication}", detail=detail, console=con), one_thread():
        report = api.verify(plan, cfg.model, VERIFY_STEPS, overrides=overrides, data=train_data,
                            device="cpu", progress=False,  # the bar above says it
                            **_options(cfg.steps))  # fmt: skip
    print_report(con, report)
    if not report.ok:
        failed += [f"verify of {plan.replication}: {f}" for f in report.failures or ["MISMATCH"]]
    return failed


def _run_choice(
    con: Console,
    cfg: DemoConfig,
    out: Path,
    planned: _Planned,
    overrides: dict[str, Any],
    train_data: Any,
    metrics: list[Any],
) -> list[str]:
    """The planner's choice over the trained run's first batches: its losses must match, and
    its measured step is printed beside the predicted one. Returns the checks that failed."""
    from dapple import api

    plan, choice = planned.trained.plan, planned.choice
    steps = _choice_steps(cfg.steps)
    path = out / "choice-metrics.jsonl"
    with run_progress(con, f"train {choice.plan.replication}", steps, path):
        mine = api.train(choice.plan, cfg.model, steps, overrides=overrides, data=train_data,
                         metrics_path=str(path), **_options(cfg.steps))  # fmt: skip
    gap = max(abs(a.loss - b.loss) for a, b in zip(mine, metrics, strict=False))
    con.print(
        f"dapple's choice {choice.label}: losses {mine[0].loss:.4f} .. {mine[-1].loss:.4f}, "
        f"largest difference from the {plan.replication} run's {_first(steps)} (same batches, "
        f"same lr) {gap:.2e}"
    )
    con.print(
        f"step time of {choice.label}: predicted {choice.step_ms:.1f} ms, measured "
        f"{median_step_ms(mine, 1):.1f} ms (median after the first step); {plan.replication}: "
        f"predicted {plan.predicted_step_ms:.1f} ms, measured {median_step_ms(metrics, 3):.1f} ms"
    )
    if gap > LOSS_GAP_RTOL * abs(metrics[0].loss):
        return [f"{choice.label} losses differ from the {plan.replication} run's by {gap:.2e}"]
    return []
