"""dapple's plan against the best torchtitan-style uniform grid: Llama-3 8B and 70B on H100s.

For each model and cluster size: the grid baseline (:mod:`dapple.planner.grid`: every
dp x tp x pp, DDP or FSDP, every M, 1F1B or interleaved 1F1B, the best by the cost model's L)
and dapple's search (:func:`dapple.planner.search.dapple_search` with tensor widths 1/2/4/8 and
interleaved 1F1B, run with ZeRO 0 and with ZeRO-3, the better kept) at the same global batch,
both simulated
(:func:`dapple.simulate.simulate`): step time, L, tokens/s/GPU, peak memory per device, planning
time, and per device group what each plan does (layers, replicas x width, F + B per
micro-batch, AR + U), which is where the speed-up comes from.

Profiles are analytic (``analytic_profile(model, "h100", precision="bf16", recompute=...)``),
sequence 8192; the cluster is the ``h100-8x`` preset with 8, 32 or 64 servers. The global
batch is torchtitan's samples per GPU (published rows in ``published_runs.toml``) x GPUs.

Usage: ``python benchmarks/plan_space.py [--out benchmarks/plan_space.md] [--servers 8 32 64]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from _bench_common import header, write_report
from dapple.core.cluster import GIB, Cluster
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.terms import stage_terms
from dapple.planner.grid import GridCandidate, grid_candidates
from dapple.planner.search import dapple_search
from dapple.planner.widths import width_candidates
from dapple.profiler.analytic import analytic_profile
from dapple.simulate import simulate
from published import load_runs

SEQ = 8192
"""Tokens per sample: torchtitan's Llama 3 runs (``llama3_8b.toml``, ``llama3_70b.toml``)."""

CHECKPOINTS = {"llama3-8b": ("selective", "full"), "llama3-70b": ("full",)}
"""Activation checkpointing profiles each planner chooses from, per model (the one of least L
wins): torchtitan's published H100 runs use selective (op policy; the profile's ``selective``
mode) for 8B and full for 70B (rows ``torchtitan-h100-8b-fsdp128``, ``torchtitan-h100-70b-2d``);
8B may also take full, as a torchtitan user may choose it."""

BATCH_ROWS = {"llama3-8b": "torchtitan-h100-8b-fsdp128", "llama3-70b": "torchtitan-h100-70b-2d"}
"""The published torchtitan row each model's samples per GPU come from (global batch / GPUs)."""

ZERO_STAGES = (0, 3)
"""dapple's search runs once per zero stage (DDP, ZeRO-3); the plan of least L is kept."""


def samples_per_gpu(model: str) -> int:
    """Global batch / GPUs of the model's torchtitan row (:data:`BATCH_ROWS`)."""
    _, runs = load_runs()
    row = next(r for r in runs if r["id"] == BATCH_ROWS[model])
    return int(row["parallel"]["global_batch"] // row["cluster"]["gpus"])


@dataclass(frozen=True, slots=True)
class Side:
    """One planner's plan, planned and simulated."""

    plan: Plan
    checkpoint: str
    """The activation checkpointing profile the plan was made with."""
    profile: ModelProfile
    planning_s: float
    L_ms: float
    step_ms: float
    peak_gib: float
    tokens_per_s_per_gpu: float


@dataclass(frozen=True, slots=True)
class Case:
    """One model on one cluster at one global batch."""

    model: str
    gpus: int
    B: int
    grid: Side
    dapple: Side
    grid_top: tuple[GridCandidate, ...]
    cluster: Cluster

    @property
    def speedup(self) -> float:
        """Simulated grid step / simulated dapple step."""
        return self.grid.step_ms / self.dapple.step_ms


Profiles = dict[str, ModelProfile]
"""Activation checkpointing mode -> the model's profile with it."""


def _side(
    planned: tuple[str, Plan], planning_s: float, profiles: Profiles, cluster: Cluster, seq: int
) -> Side:
    ac, plan = planned
    sim = simulate(plan, profiles[ac], cluster)
    peak = max(d.peak_memory_bytes for d in sim.devices) / GIB
    tps = plan.global_batch_size * seq / (sim.step_ms / 1e3) / cluster.num_devices
    return Side(plan, ac, profiles[ac], planning_s, plan.predicted_step_ms, sim.step_ms, peak, tps)


def plan_dapple(profiles: Profiles, cluster: Cluster, B: int) -> tuple[tuple[str, Plan], float]:
    """dapple's best ``(checkpointing, plan)`` over the profiles and :data:`ZERO_STAGES` (every
    width, interleaved 1F1B included), and the total planning seconds."""
    t0 = time.perf_counter()
    plans = [
        (
            ac,
            dapple_search(
                prof,
                cluster,
                B,
                tensor_widths=width_candidates(prof, cluster),
                zero_stage=z,
                interleaved=True,
            ),
        )
        for ac, prof in profiles.items()
        for z in ZERO_STAGES
    ]
    return min(plans, key=lambda x: x[1].predicted_step_ms), time.perf_counter() - t0


def plan_grid(
    profiles: Profiles, cluster: Cluster, B: int, top: int
) -> tuple[tuple[str, Plan], float, tuple[GridCandidate, ...]]:
    """The grid's best ``(checkpointing, plan)`` over the profiles, its planning seconds and the
    ``top`` best feasible candidates of that profile."""
    t0 = time.perf_counter()
    best: dict[str, list[GridCandidate]] = {}
    for ac, prof in profiles.items():
        cands = grid_candidates(prof, cluster, B)
        best[ac] = sorted((c for c in cands if c.fits), key=lambda c: c.L_ms)
    seconds = time.perf_counter() - t0
    ranked = sorted((fits[0].L_ms, ac) for ac, fits in best.items() if fits)
    if not ranked:
        raise SystemExit(f"grid: no candidate fits {cluster.name} at B={B}")
    ac = ranked[0][1]
    return (ac, best[ac][0].plan), seconds, tuple(best[ac][:top])


def compare(
    model: str, profiles: Profiles, cluster: Cluster, B: int, seq: int = SEQ, top: int = 5
) -> Case:
    """Plan the model on ``cluster`` with both planners and simulate both plans."""
    g_plan, g_s, g_top = plan_grid(profiles, cluster, B, top)
    d_plan, d_s = plan_dapple(profiles, cluster, B)
    return Case(
        model=model,
        gpus=cluster.num_devices,
        B=B,
        grid=_side(g_plan, g_s, profiles, cluster, seq),
        dapple=_side(d_plan, d_s, profiles, cluster, seq),
        grid_top=g_top,
        cluster=cluster,
    )


# -- text -------------------------------------------------------------------------------------


def shape(plan: Plan) -> str:
    """``dp16 x tp2 x pp4 FSDP M=8 1F1B``-style text when uniform, else per device group."""
    groups = plan.stages[: plan.num_groups]
    zero = {("FSDP" if s.zero_stage == 3 else f"ZeRO-{s.zero_stage}" if s.zero_stage else "DDP")
            + ("+regather" if s.regather else "") for s in plan.stages}  # fmt: skip
    sched = (f"interleaved v={plan.virtual_stages}" if plan.virtual_stages > 1 else
             f"1F1B ({plan.policy})" if plan.schedule == "dapple" else plan.schedule)  # fmt: skip
    rc = " RC" if any(s.recompute for s in plan.stages) else ""
    bound = " D" if any(s.max_in_flight is not None for s in plan.stages) else ""
    if len({(s.replicas, s.tensor_width) for s in groups}) == 1:
        dims = f"dp{groups[0].replicas} x tp{groups[0].tensor_width} x pp{plan.num_groups}"
    else:
        dims = "pp" + str(plan.num_groups) + " [" + widths_text(plan) + "]"
    return f"{dims} {'/'.join(sorted(zero))} M={plan.num_micro_batches} {sched}{rc}{bound}"


def widths_text(plan: Plan) -> str:
    """Replicas and width of each device group, runs of equal groups counted:
    ``dp2 tp4, 3 x dp4 tp2, 2 x dp4 tp4``."""
    runs: list[list[int | str]] = []
    for st in plan.stages[: plan.num_groups]:
        g = f"dp{st.replicas} tp{st.tensor_width}"
        if runs and runs[-1][1] == g:
            runs[-1][0] = int(runs[-1][0]) + 1
        else:
            runs.append([1, g])
    return ", ".join(f"{n} x {g}" if n != 1 else str(g) for n, g in runs)


def cuts_text(plan: Plan) -> str:
    """Layers per device group: ``9+9+8+8`` (chunks summed under interleaving)."""
    P = plan.num_groups
    counts = [sum(plan.stages[k].layers[1] - plan.stages[k].layers[0]
                  for k in range(g, plan.num_stages, P)) for g in range(P)]  # fmt: skip
    return "+".join(str(n) for n in counts)


def group_rows(plan: Plan, prof: ModelProfile, cluster: Cluster) -> list[str]:
    """One markdown row per device group: layers, r x t, zero, F + B of one micro-batch
    (its slowest replica's slice, summed over its chunks), AR + U."""
    terms = stage_terms(plan, prof, cluster)
    P, rows = plan.num_groups, []
    for g in range(P):
        mine = range(g, plan.num_stages, P)
        fb = sum(terms.stages[k].terms.forward_ms + terms.stages[k].terms.backward_ms for k in mine)
        ar = sum(terms.stages[k].terms.sync_ms + terms.stages[k].terms.update_ms for k in mine)
        st = plan.stages[g]
        layers = ", ".join(
            f"{plan.stages[k].layers[0]}-{plan.stages[k].layers[1] - 1}" for k in mine
        )
        zero = f"{st.zero_stage}{'R' if st.regather else ''}"
        rows.append(f"| {g} | {layers} | {st.replicas} x {st.tensor_width} | {zero} | "
                    f"{'yes' if st.recompute else 'no'} | {fb:,.1f} | {ar:,.1f} |")  # fmt: skip
    return rows


def _steady_ms(s: Side, cluster: Cluster) -> float:
    """M x the largest per-micro-batch F + B of a device group (its chunks summed)."""
    terms, P = stage_terms(s.plan, s.profile, cluster), s.plan.num_groups
    work = [
        sum(terms.stages[k].terms.forward_ms + terms.stages[k].terms.backward_ms
            for k in range(g, s.plan.num_stages, P))
        for g in range(P)
    ]  # fmt: skip
    return s.plan.num_micro_batches * max(work)


def _side_row(name: str, s: Side) -> str:
    return (f"| {name} | {s.checkpoint} | {shape(s.plan)} | {cuts_text(s.plan)} | {s.L_ms:,.0f} | "
            f"{s.step_ms:,.0f} | {s.tokens_per_s_per_gpu:,.0f} | {s.peak_gib:.1f} | {s.planning_s:.1f} |")  # fmt: skip


def differences(c: Case) -> list[str]:
    """What differs between the two plans, one bullet each (what the speed-up comes from)."""
    g, d = c.grid, c.dapple
    out = [
        f"- schedule: grid {_sched(g.plan)}, dapple {_sched(d.plan)}; M {g.plan.num_micro_batches}"
        f" vs {d.plan.num_micro_batches} (micro-batch {g.plan.micro_batch_size} vs "
        f"{d.plan.micro_batch_size} samples)",
        f"- device groups: grid {g.plan.num_groups} [{widths_text(g.plan)}], dapple "
        f"{d.plan.num_groups} [{widths_text(d.plan)}]; layers per group grid "
        f"{cuts_text(g.plan)}, dapple {cuts_text(d.plan)}",
        f"- activation checkpointing: grid {g.checkpoint}, dapple {d.checkpoint}"
        + ("; dapple re-computes some stages" if any(x.recompute for x in d.plan.stages) else ""),
    ]
    for name, s in (("grid", g), ("dapple", d)):
        steady = _steady_ms(s, c.cluster)
        out.append(
            f"- {name}: M x max F+B = {steady:,.0f} ms of the {s.step_ms:,.0f} ms simulated "
            f"step; the other {s.step_ms - steady:,.0f} ms are fill, drain and the AR+U tail; "
            f"L / simulated = {s.L_ms / s.step_ms:.3f}"
        )
    return out


def _sched(plan: Plan) -> str:
    if plan.virtual_stages > 1:
        return f"interleaved 1F1B v={plan.virtual_stages}"
    return f"1F1B policy {plan.policy}" if plan.schedule == "dapple" else plan.schedule


def case_lines(c: Case) -> list[str]:
    """The section of one case: both plans, the speed-up, per-group anatomy, grid runners-up."""
    title = f"{c.model} on {c.gpus} H100, global batch {c.B}"
    verdict = "dapple faster" if c.speedup > 1 else "**dapple slower**" if c.speedup < 1 else "tie"
    lines = [f"### {title}", "",
             "| planner | AC | plan | layers per group | L (ms) | simulated step (ms) | tok/s/GPU | "
             "peak GiB (of 80) | planning s |", "|---|---|---|---|---:|---:|---:|---:|---:|",
             _side_row("grid", c.grid), _side_row("dapple", c.dapple), "",
             f"Speed-up (grid step / dapple step, simulated): **{c.speedup:.3f}x** ({verdict}); "
             f"by L: {c.grid.L_ms / c.dapple.L_ms:.3f}x.", ""]  # fmt: skip
    lines += [*differences(c), ""]
    head = ["| group | layers | r x t | zero | RC | F+B per micro-batch (ms) | AR+U (ms) |",
            "|---:|---|---|---|---|---:|---:|"]  # fmt: skip
    for name, s in (("grid", c.grid), ("dapple", c.dapple)):
        lines += [f"{name}: {shape(s.plan)}", "", *head,
                  *group_rows(s.plan, s.profile, c.cluster), ""]  # fmt: skip
    lines += [f"Grid runners-up by L (AC {c.grid.checkpoint}):", ""]
    lines += [f"- {x.point.label}: L {x.L_ms:,.0f} ms" for x in c.grid_top[1:]]
    return [*lines, ""]


def summary_lines(cases: Sequence[Case]) -> list[str]:
    lines = ["## Summary", "",
             "| model | GPUs | B | grid plan | dapple plan | grid step (ms) | dapple step (ms) | "
             "speed-up | grid tok/s/GPU | dapple tok/s/GPU | peak GiB grid / dapple | planning s grid / dapple |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    for c in cases:
        g, d = c.grid, c.dapple
        lines.append(f"| {c.model} | {c.gpus} | {c.B} | {shape(g.plan)} | {shape(d.plan)} | "
                     f"{g.step_ms:,.0f} | {d.step_ms:,.0f} | {c.speedup:.3f}x | {g.tokens_per_s_per_gpu:,.0f} | "
                     f"{d.tokens_per_s_per_gpu:,.0f} | {g.peak_gib:.1f} / {d.peak_gib:.1f} | "
                     f"{g.planning_s:.1f} / {d.planning_s:.1f} |")  # fmt: skip
    slower = [c for c in cases if c.dapple.step_ms > c.grid.step_ms or c.dapple.L_ms > c.grid.L_ms]
    lines += ["", f"- dapple slower than the grid (simulated step or L) in {len(slower)} of "
              f"{len(cases)} cases{':' if slower else '.'}"]  # fmt: skip
    lines += [f"  - {c.model} on {c.gpus}: {c.speedup:.3f}x simulated, "
              f"{c.grid.L_ms / c.dapple.L_ms:.3f}x by L; {why_slower(c)}" for c in slower]  # fmt: skip
    same = [c for c in cases if same_plan(c)]
    lines.append(f"- dapple's plan is the grid's own in {len(same)} of {len(cases)} cases"
                 + (": " + ", ".join(f"{c.model} on {c.gpus}" for c in same) if same else "."))  # fmt: skip
    faster = [c for c in cases if c.speedup > 1 and c.dapple.L_ms < c.grid.L_ms]
    lines.append(f"- dapple faster by both L and simulated step in {len(faster)} of {len(cases)} "
                 "cases" + (": " + ", ".join(f"{c.model} on {c.gpus} {c.speedup:.3f}x" for c in faster)
                            if faster else "."))  # fmt: skip
    return [*lines, ""]


def why_slower(c: Case) -> str:
    """What the numbers say about a case where dapple is slower than the grid."""
    g, d = c.grid, c.dapple
    out = []
    if d.L_ms > g.L_ms:
        out.append(
            "slower by L too: dapple's search missed a grid point it offers itself "
            f"({'an interleaved' if g.plan.virtual_stages > 1 else 'a 1F1B'} one)"
        )
    elif d.step_ms > g.step_ms:
        out.append(
            f"by L dapple is the faster, the simulator disagrees (L / simulated {d.L_ms / d.step_ms:.3f} "
            f"for dapple's plan, {g.L_ms / g.step_ms:.3f} for the grid's)"
        )
    return "; ".join(out)


def same_plan(c: Case) -> bool:
    """dapple's plan is the grid's (its stages, M and schedule)."""
    g, d = c.grid.plan, c.dapple.plan
    return (g.stages, g.num_micro_batches, g.schedule, g.virtual_stages) == (
        d.stages,
        d.num_micro_batches,
        d.schedule,
        d.virtual_stages,
    )


def report(cases: Sequence[Case], command: str, notes: Sequence[str] = ()) -> list[str]:
    """The markdown of ``plan_space.md``."""
    lines = header("dapple's plan vs the best torchtitan-style grid (Llama-3, H100)", command)
    lines[-2] = ("- numbers are analytic (cost model and simulator, no GPU); planning seconds are "
                 "wall time on this machine, " + lines[-2][2:])  # fmt: skip
    lines += summary_lines(cases)
    for c in cases:
        lines += case_lines(c)
    return [*lines, *notes]


def profiles_for(model: str) -> Profiles:
    """The analytic H100 bf16 profiles at :data:`SEQ`, one per :data:`CHECKPOINTS` mode."""
    return {
        ac: analytic_profile(model, "h100", precision="bf16", seq_len=SEQ, recompute=ac)
        for ac in CHECKPOINTS[model]
    }


NOTES: list[str] = """## How to read this

- Both planners see the same profile, cluster and global batch and are scored by the same cost
  model (L, equations 1-3; interleaved 1F1B by its own step rule); the simulator replays each
  plan's schedule. Peak memory is the simulator's, max over devices, against 80 GiB.
- grid: `dapple.planner.grid` - torchtitan's mesh `[pp, dp, tp]` with every stage on dp x tp
  devices, layers split as torchtitan's `generate_llm_fqn_per_model_part`, DDP or FSDP
  (re-gathering per micro-batch where memory needs it), M with a whole local batch per replica,
  1F1B (policy A) or interleaved 1F1B v=2, no extra re-computation.
- dapple: `dapple_search(tensor_widths=(1, 2, 4, 8), zero_stage=z, interleaved=True)` for
  z = 0 and 3 on each checkpointing profile, the lowest L kept: any cut, any replica count per
  stage, a tensor width per stage (the uniform-width searches refined stage by stage,
  `dapple.planner.stage_widths`), policy A or B, re-computation and an in-flight bound D per
  stage where memory needs them; the grid's points inside that space; and interleaved 1F1B
  (v = 2): its own plans cut into chunks and the grid's interleaved points, each also with its
  chunk boundaries re-balanced by time (`dapple.planner.interleaving`). Its planning time is the
  sum of all its searches; the grid's likewise over the profiles.
- Checkpointing: torchtitan runs 8B with selective (op) and 70B with full activation
  checkpointing. The analytic profile's `selective` mode drops only eager attention's
  probabilities, so with flash attention (bf16) it keeps what no checkpointing keeps; 8B is
  therefore planned on two profiles, `selective` and `full`, and each planner keeps the one of
  least L (the `AC` column). dapple may also re-compute single stages (keeping only the stage
  input); the grid does not.
- Cluster `h100-8x`: 8 H100 80 GiB per server, NVLink 450 GB/s, 400 Gbit/s between servers
  (one NIC per server, an eighth of torchtitan's Grand Teton hosts).
- Global batch: 2 samples of 8192 tokens per GPU, as torchtitan's rows `torchtitan-h100-8b-fsdp128`
  (local batch 2 x FSDP 128 = 256 on 128 GPUs) and `torchtitan-h100-70b-2d` (16 x dp 32 = 512 on
  256 GPUs) in `published_runs.toml`: 128, 512 and 1024 samples on 64, 256 and 512 GPUs.

## Findings (written from the runs of 2026-11-26 13:05 and 13:07 UTC, equal but for planning time; the tables above are regenerated by each run, this section is not)

- dapple is never slower than the grid, by L or simulated: its search offers every grid point
  inside its space, interleaved ones included (`dapple.planner.interleaving`), so at worst it
  returns the grid's own plan. That is what happens for Llama-3 70B on 256 and 512 GPUs
  (1.000x): the grid's dp x tp2 x pp8 FSDP M=32 interleaved v=2 is also dapple's best.
- Llama-3 8B, 1.172x (64 GPUs), 1.072x (256), 1.071x (512) simulated; 1.178x, 1.039x, 1.038x
  by L. dapple keeps the grid's mesh (dp x tp1 x pp4 FSDP, M = 8, interleaved v = 2) and moves
  the chunk boundaries by time instead of by layer count: 9+9+9+7 layers per group instead of
  9+9+8+8, because the group with the LM head (about 2.4 blocks' worth of F+B) is the slowest
  in torchtitan's split. M x max F+B drops from 1,606 to 1,534 ms. On 64 GPUs the grid's best
  is 1F1B: its interleaved v=2 of that mesh needs 81.1 GiB on the first group without
  re-gathering (torchtitan's first chunk holds the embedding and 4 blocks, dapple's 3, and the
  first chunk is most in flight), while dapple's peaks at 77.3 GiB. The step rule over-estimates dapple's re-balanced plan
  (L / simulated 1.018) and under-estimates the grid's (0.986), hence the gap between the two
  speed-ups on 256 and 512 GPUs.
- Llama-3 70B on 64 GPUs, 1.074x simulated (1.075x by L): dapple's own plan interleaved, 8
  groups of mixed width (dp1 x tp8 on the embedding's group, dp2 x tp4 on the other seven),
  DDP, M = 64, chunks re-balanced by time, against the grid's best dp4 x tp2 x pp8 FSDP 1F1B
  M = 32. Its steady part is longer (18,248 vs 17,366 ms) but fill, drain and the AR+U tail
  shrink from 3,398 to 1,077 ms (no FSDP traffic, half the bubble).
- Why no gain on 70B at 256 and 512 GPUs: there the per-group F+B of the best mesh is bound by
  granularity - 80 blocks, an embedding and a head on 8 groups leave some group 11 blocks
  (542.7 ms) whatever the cuts, and the other meshes (pp16, wider tp, DDP) are slower by L;
  dapple's mixed-width 1F1B plans, interleaved, do not beat it either.
- Planning time is wall-clock on 2 cores shared with other jobs and varies about 2x with their
  load (runs at 13:05 and 13:07 UTC, load 2.5 and 4.0: the grid 0.5-3.0 s and 0.5-4.4 s, dapple
  1.4-17.7 s and 3.0-33.9 s). dapple's is the sum of 2 or 4 searches (profiles x zero stages),
  each with 4 widths, the per-stage width refinement, the grid's points and the interleaved
  candidates. One search's CPU time is in `planning_time.md`: Llama-3 70B on 512 H100 with
  ZeRO-3 and interleaving, 3.8 CPU s (6.3 s wall at load 4.6).
""".splitlines()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--models", nargs="+", default=list(CHECKPOINTS), choices=list(CHECKPOINTS))
    ap.add_argument("--servers", nargs="+", type=int, default=[8, 32, 64])
    args = ap.parse_args(argv)
    cases = []
    for model in args.models:
        profiles, per_gpu = profiles_for(model), samples_per_gpu(model)
        for n in args.servers:
            cluster = load_cluster("h100-8x", servers=n)
            print(f"planning {model} on {cluster.num_devices} GPUs ...", file=sys.stderr)
            cases.append(compare(model, profiles, cluster, per_gpu * cluster.num_devices))
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python benchmarks/plan_space.py {argv_text}".strip()
    write_report(report(cases, command, NOTES), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
