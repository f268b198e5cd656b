"""The paper's section-7 tables reproduced with dapple's planner and simulator (analytic V100
profiles), plus the real runtime's CPU activation memory for the GPipe comparison.

Tables (each beside the paper's numbers):

1. DAPPLE planner vs PipeDream's planner (section 7.5, table "strategy comparison" and the
   speed-up figure): VGG-19, AmoebaNet-36, BERT-large and XLNet-36 on config A with 2 and 4
   servers; simulated speed-up of each plan over the best DP plan, and DAPPLE / PipeDream.
2. DAPPLE vs GPipe on BERT-48 (section 7.4): 2 stages, one V100 each (config B), micro-batch
   2, M = 2..16 with and without re-computation; simulated throughput and average peak
   memory, OOM above 16 GB; then the real runtime's held-activation peak on CPU for the same
   schedules and M on a small BERT-style zoo transformer.
3. Policy A vs B (K_i, section 7.3): the DAPPLE plan of each model on 2 x 8 config A,
   simulated with each warm-up policy.

Usage: ``python benchmarks/paper.py [--no-runtime]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import HERE, header, load_note
from dapple.core.cluster import GIB
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import DappleError
from dapple.planner import make_plan
from dapple.profiler.paper_models import PAPER_GLOBAL_BATCH, paper_profile
from dapple.simulate import simulate

PIPEDREAM_GBS = {"vgg19": 1024, "amoebanet36": 128, "bert24": 128, "xlnet36": 128}
"""Global batch sizes of the paper's DAPPLE-vs-PipeDream strategy table."""

PAPER_POLICY_SPEEDUP = {"bert48": 1.0, "xlnet36": 1.02, "vgg19": 1.1, "gnmt16": 1.31}
"""Table "scheduling policies": throughput of P_B over P_A on 2 x 8 config A."""

PAPER_GPIPE: dict[tuple[str, bool], dict[int, tuple[float, float] | None]] = {
    ("gpipe", False): {2: (5.10, 12.1), 3: None},
    ("gpipe", True): {2: (4.00, 9.9), 5: (5.53, 13.2), 8: None},
    ("dapple", False): {2: (5.10, 10.6), 8: (7.60, 10.6), 16: (8.18, 10.6)},
    ("dapple", True): {2: (4.24, 8.5), 8: (6.23, 8.5), 16: (6.77, 8.5)},
}
"""Table "DAPPLE vs GPipe": (samples/s, average peak GB) per M; None = OOM."""

PAPER_PIPEDREAM_PLANS = {
    "vgg19": ("14:2 (0-16 | 17-25)", "8:6:1:1"),
    "amoebanet36": ("8:8 (0-30 | 31-43)", "straight"),
    "bert24": ("8:8 (0-13 | 14-26)", "2:6:2:2:2:2"),
    "xlnet36": ("8:8 (0-22 | 23-41)", "straight"),
}
"""The paper's 2 x 8 strategies (DAPPLE, PipeDream)."""


def bert24() -> ModelProfile:
    """BERT-large: the bert48 analytic profile's embedding, first 24 blocks and head (the
    blocks have BERT-large's widths: hidden 1024, 16 heads, sequence 512)."""
    p = paper_profile("bert48")
    layers = (*p.layers[:25], p.layers[-1])
    return dataclasses.replace(p, model_name="bert24", layers=layers)


def profile_of(name: str) -> ModelProfile:
    return bert24() if name == "bert24" else paper_profile(name)


def shape(plan: Plan) -> str:
    if all(s.replicas == 1 for s in plan.stages) and plan.num_stages > 2:
        reps = f"straight x{plan.num_stages}"
    else:
        reps = ":".join(str(s.replicas) for s in plan.stages)
    cuts = " | ".join(f"{s.layers[0]}-{s.layers[1] - 1}" for s in plan.stages)
    rc = " RC" if any(s.recompute for s in plan.stages) else ""
    return f"{reps} ({cuts}) M={plan.num_micro_batches}{rc}"


def _sim_ms(plan: Plan, prof: ModelProfile, cluster: Any) -> tuple[float, bool]:
    r = simulate(plan, prof, cluster)
    return r.step_ms, r.peak_memory_bytes <= cluster.device_memory_bytes


def planner_vs_pipedream() -> list[str]:
    out = [
        "## 1. DAPPLE planner vs PipeDream's planner (config A, simulated)",
        "",
        "Both planners get the same profile and cluster; both plans run under DAPPLE's schedule "
        "(as in the paper, section 7.5). Speed-up = simulated step time of the best DP plan "
        "(`make_plan(.., 'dp')`: all devices, gradient accumulation) / the plan's. BERT-large = "
        "`bert24`, the analytic BERT-48 profile cut to its first 24 blocks (BERT-large widths). "
        "Global batch as in the paper's strategy table.",
        "",
        "| model (GBS) | cluster | DAPPLE plan | PipeDream plan | DP ms | DAPPLE speed-up "
        "| PipeDream speed-up | DAPPLE / PipeDream |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    best = 0.0
    for name, gbs in PIPEDREAM_GBS.items():
        prof = profile_of(name)
        for servers in (2, 4):
            cluster = load_cluster("paper-a", servers=servers)
            plans: dict[str, Plan | None] = {}
            for planner in ("dapple", "pipedream", "dp"):
                try:
                    plans[planner] = make_plan(prof, cluster, gbs, planner)
                except DappleError:
                    plans[planner] = None
            ms = {
                k: (_sim_ms(p, prof, cluster)[0] if p else float("nan")) for k, p in plans.items()
            }
            sp_d = ms["dp"] / ms["dapple"]
            sp_p = ms["dp"] / ms["pipedream"]
            ratio = ms["pipedream"] / ms["dapple"]
            best = max(best, ratio) if ratio == ratio else best
            dap, pd = plans["dapple"], plans["pipedream"]
            out.append(
                f"| {name} ({gbs}) | {servers}x8 | {shape(dap) if dap else 'infeasible'} | "
                f"{shape(pd) if pd else 'infeasible'} | "
                f"{ms['dp']:.0f}{'' if plans['dp'] else ' (OOM)'} | {sp_d:.2f} | {sp_p:.2f} | "
                f"**{ratio:.2f}x** |"
            )
    out += [
        "",
        f"Largest DAPPLE / PipeDream ratio here: **{best:.2f}x** (paper: up to 3.23x). "
        "The paper's 2 x 8 strategies (DAPPLE; PipeDream): "
        + "; ".join(f"{k}: {a}; {b}" for k, (a, b) in PAPER_PIPEDREAM_PLANS.items())
        + ". Where DP does not fit (NaN) the paper also reports NaN.",
        "",
    ]
    return out


def two_stage(n_layers: int, cut: int, M: int, schedule: str, rc: bool, b: int = 2) -> Plan:
    """Two stages cut at ``cut``, one device each, micro-batch ``b``, re-computation ``rc``."""
    p = straight_plan(
        n_layers, [0, cut], global_batch_size=b * M, num_micro_batches=M, schedule=schedule
    )
    return dataclasses.replace(
        p,
        stages=tuple(dataclasses.replace(s, recompute="full" if rc else "none") for s in p.stages),
    )


def dapple_vs_gpipe() -> tuple[list[str], int]:
    prof = paper_profile("bert48")
    cluster = load_cluster("paper-b")
    n = prof.num_layers
    cut = min(
        range(1, n),
        key=lambda c: pipeline_latency(two_stage(n, c, 2, "dapple", False), prof, cluster).L_ms,
    )
    cap = cluster.device_memory_bytes
    out = [
        "## 2. DAPPLE vs GPipe on BERT-48 (config B, 2 stages, micro-batch 2, simulated)",
        "",
        f"Profile `paper:bert48` ({n} layers), cut after layer {cut - 1} (the cut minimising L; "
        f"the paper's 23:25 on 48 blocks), one V100 per stage, capacity "
        f"{cap / GIB:.0f} GB. Throughput = 2M / simulated step; memory = the simulator's peak "
        "(weights + gradients + optimizer state + held activations) averaged over the two "
        "devices; OOM when a device exceeds the capacity. Paper values in brackets.",
        "",
        "| schedule | RC | M | samples/s [paper] | avg peak GB [paper] |",
        "|---|---|---:|---|---|",
    ]
    res: dict[tuple[str, bool, int], tuple[float, float, bool]] = {}
    for schedule in ("gpipe", "dapple"):
        for rc in (False, True):
            for M in (2, 3, 4, 5, 8, 16):
                plan = two_stage(n, cut, M, schedule, rc)
                r = simulate(plan, prof, cluster)
                avg = sum(d.peak_memory_bytes for d in r.devices) / len(r.devices)
                ok = r.peak_memory_bytes <= cap
                res[(schedule, rc, M)] = (2 * M / (r.step_ms / 1e3), avg, ok)
                paper = PAPER_GPIPE[(schedule, rc)].get(M, "-")
                ps, pm = (
                    ("OOM", "OOM")
                    if paper is None
                    else (("-", "-") if paper == "-" else (f"{paper[0]:.2f}", f"{paper[1]:.1f}"))
                )
                tput = f"{2 * M / (r.step_ms / 1e3):.2f}" if ok else "OOM"
                out.append(
                    f"| {'DAPPLE' if schedule == 'dapple' else 'GPipe'} | {'yes' if rc else 'no'} "
                    f"| {M} | {tput} [{ps}] | {avg / GIB:.1f}{'' if ok else ' (OOM)'} [{pm}] |"
                )
    fit_g = [M for (s, rc, M), v in res.items() if s == "gpipe" and not rc and v[2]]
    g_best = max(fit_g) if fit_g else None
    d16 = res[("dapple", False, 16)]
    if g_best is not None and d16[2]:
        g = res[("gpipe", False, g_best)]
        g2 = res[("gpipe", False, 2)]
        rc16 = res[("dapple", True, 16)]
        out += [
            "",
            f"DAPPLE M=16 vs GPipe M=2 (the paper's baseline), both without RC: "
            f"**{d16[0] / g2[0]:.2f}x** throughput at **{d16[1] / g2[1]:.2f}x** average peak "
            f"memory (paper: 1.6x at 0.88x); vs GPipe at its largest fitting M here ({g_best}; "
            f"the paper's GPipe OOMs at M=3): {d16[0] / g[0]:.2f}x at {d16[1] / g[1]:.2f}x. "
            f"DAPPLE + RC at M=16 uses {rc16[1] / g2[1]:.2f}x GPipe M=2's memory (paper: 0.70x).",
        ]
    _plot_gpipe(res, cap)
    out += ["", "![DAPPLE vs GPipe on BERT-48](paper_gpipe.png)", ""]
    return out, cut


def _plot_gpipe(res: dict[tuple[str, bool, int], tuple[float, float, bool]], cap: float) -> None:
    """Throughput and average peak memory vs M, one line per schedule x RC (paper_gpipe.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for (schedule, rc), style in {
        ("gpipe", False): "o-",
        ("gpipe", True): "o--",
        ("dapple", False): "s-",
        ("dapple", True): "s--",
    }.items():
        ms = sorted(M for (s, r, M) in res if s == schedule and r == rc)
        name = ("DAPPLE" if schedule == "dapple" else "GPipe") + (" + RC" if rc else "")
        fit = [M for M in ms if res[(schedule, rc, M)][2]]
        kw = {"markersize": 10, "fillstyle": "none"} if schedule == "gpipe" else {}
        ax1.plot(fit, [res[(schedule, rc, M)][0] for M in fit], style, label=name, **kw)
        ax2.plot(ms, [res[(schedule, rc, M)][1] / GIB for M in ms], style, label=name, **kw)
    ax2.axhline(cap / GIB, color="red", lw=1, label="V100 16 GB")
    ax1.set(xlabel="micro-batches M", ylabel="samples/s (simulated)", title="Throughput")
    ax2.set(xlabel="micro-batches M", ylabel="GB", title="Average peak memory", ylim=(0, 40))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        "BERT-48, 2 stages, micro-batch 2, config B (OOM omitted; hollow GPipe markers "
        "coincide with DAPPLE where equal)"
    )
    fig.tight_layout()
    fig.savefig(HERE / "paper_gpipe.png", dpi=90)
    plt.close(fig)


# -- runtime: CPU held-activation peaks --------------------------------------------------------
def _mem_worker(rank: int, world: int, port: int, cases: list[dict[str, Any]], out: str) -> None:
    import torch
    import torch.distributed as dist

    from dapple.models.zoo import transformer
    from dapple.runtime import TrainConfig, run_plan, shutdown_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    wl = transformer(**RUNTIME_MODEL)
    peaks = []
    for c in cases:
        cfg = TrainConfig(steps=1, device="cpu")
        run = run_plan(Plan.from_dict(c), wl, cfg, device=torch.device("cpu"))
        if rank == 0:
            peaks.append(list(run.metrics[0].peak_memory_bytes))
    if rank == 0:
        Path(out).write_text(json.dumps(peaks))
    shutdown_distributed()


RUNTIME_MODEL: dict[str, Any] = {
    "layers": 6,
    "hidden": 128,
    "heads": 4,
    "seq": 128,
    "vocab": 512,
    "name": "bert-mini",
}
"""Small BERT-style (pre-LN transformer) zoo model for the runtime memory measurement."""


def runtime_memory() -> list[str]:
    import torch.multiprocessing as mp

    from dapple.runtime import free_port

    n = RUNTIME_MODEL["layers"] + 2
    cut = n // 2
    keys = [(s, rc, M) for s in ("gpipe", "dapple") for rc in (False, True) for M in (2, 4, 8, 16)]
    cases = [two_stage(n, cut, M, s, rc).to_dict() for s, rc, M in keys]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "mem.json")
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_mem_worker, args=(r, 2, port, cases, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        codes = [p.exitcode for p in procs]
        if any(codes) and not Path(out).exists():
            raise RuntimeError(f"runtime memory workers failed: exit codes {codes}")
        if any(codes):  # rank 0 wrote every result first: a teardown crash loses nothing
            print(f"warning: runtime memory workers exited with {codes} after the results")
        peaks = json.loads(Path(out).read_text())
    got = dict(zip(keys, peaks, strict=True))
    lines = [
        "### 2b. Measured: the real runtime's held-activation peak (CPU)",
        "",
        f"zoo `transformer` {RUNTIME_MODEL} ({n} chain layers), 2 CPU processes, cut after "
        f"layer {cut - 1}, micro-batch 2, one step per case. Metric: the runtime's CPU "
        "`held_activations` peak per stage (tensors saved for backward + boundary activations "
        "held, parameters excluded - see `dapple.runtime.memory`), in MiB, stage 0 / stage 1. "
        "With RC only the stage inputs are held between F and B; the transient re-computed "
        "activations inside one B are not in this metric.",
        "",
        "| schedule | RC | " + " | ".join(f"M={M}" for M in (2, 4, 8, 16)) + " |",
        "|---|---|" + "---:|" * 4,
    ]
    for s in ("gpipe", "dapple"):
        for rc in (False, True):
            cells = [" / ".join(f"{v / 2**20:.1f}" for v in got[(s, rc, M)]) for M in (2, 4, 8, 16)]
            lines.append(
                f"| {'DAPPLE' if s == 'dapple' else 'GPipe'} | {'yes' if rc else 'no'} | "
                + " | ".join(cells)
                + " |"
            )
    g16, d16 = max(got[("gpipe", False, 16)]), max(got[("dapple", False, 16)])
    g2, d2 = max(got[("gpipe", False, 2)]), max(got[("dapple", False, 2)])
    lines += [
        "",
        f"GPipe's peak grows with M ({g2 / 2**20:.1f} -> {g16 / 2**20:.1f} MiB from M=2 to 16, "
        f"stage max) while DAPPLE's early backward keeps it flat ({d2 / 2**20:.1f} -> "
        f"{d16 / 2**20:.1f} MiB): at M=16 DAPPLE holds **{d16 / g16:.2f}x** GPipe's activations.",
        "",
    ]
    return lines


def policy_a_vs_b() -> list[str]:
    cluster = load_cluster("paper-a", servers=2)
    out = [
        "## 3. Warm-up policy A vs B (K_i), 2 x 8 config A, simulated",
        "",
        "Each model's DAPPLE plan (`make_plan`, the paper's GBS; VGG-19 at 1024 because at 2048 "
        "our planner picks pure DP, which has no K_i to vary), simulated with policy A "
        "(K_i = min(S - i, D)) and B (K_i = min(2(S - i) - 1, D)); speed-up = step(A) / step(B).",
        "",
        "| model (GBS) | plan | step A ms | step B ms | B over A [paper] |",
        "|---|---|---:|---:|---|",
    ]
    for name in ("bert48", "xlnet36", "vgg19", "gnmt16", "amoebanet36"):
        prof = paper_profile(name)
        # VGG-19 at GBS 2048 plans as pure DP here (no K_i to vary); 1024 gives the paper's 15:1
        gbs = 1024 if name == "vgg19" else PAPER_GLOBAL_BATCH[name]
        plan = make_plan(prof, cluster, gbs, "dapple")
        a = simulate(dataclasses.replace(plan, policy="A"), prof, cluster).step_ms
        b = simulate(dataclasses.replace(plan, policy="B"), prof, cluster).step_ms
        paper = PAPER_POLICY_SPEEDUP.get(name)
        out.append(
            f"| {name} ({gbs}) | {shape(plan)} | {a:.0f} | {b:.0f} | {a / b:.2f} "
            f"[{paper if paper is not None else '-'}] |"
        )
    out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--no-runtime", action="store_true", help="skip the CPU runtime memory runs")
    ap.add_argument("--out", default=str(HERE / "paper.md"))
    args = ap.parse_args(argv)
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python benchmarks/paper.py {args_text}".strip()
    lines = header("The paper's section-7 tables, reproduced", command)
    planning = HERE / "paper_planning.md"
    lines += [
        "Planning results (the paper's planning-results table) are in "
        + (
            "[paper_planning.md](paper_planning.md)"
            if planning.exists()
            else "`paper_planning.md` (written by the planner's `paper_planning.py`; not present at "
            "this run)"
        )
        + ". Simulated numbers use the analytic V100 profiles of `dapple.profiler.paper_models` "
        "and the `paper-a/b` cluster presets, so they test the planner and schedules against "
        "the paper's trends, not a real V100.",
        "",
    ]
    lines += planner_vs_pipedream()
    gp, _ = dapple_vs_gpipe()
    lines += gp
    if not args.no_runtime:
        lines += runtime_memory()
    lines += policy_a_vs_b()
    lines += [f"End: {load_note()}.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
