"""Measured schedules: 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV on 4 CPU processes,
beside the simulator, and dapple vs ``torch.distributed.pipelining``'s multi-stage schedules on the same partition.

Model: the zoo ``transformer`` of :data:`_bench_common.BENCH_MODEL` with ``--blocks`` blocks
(default 14: 16 chain layers, so 4 ranks x 2 chunks of 2 layers each). Partition: the straight
4-stage pipeline with equal layer counts, and (dapple only: torch cannot replicate a stage)
2:1:1 with the layers cut in proportion to the replicas. Same global batch, M, plain SGD and
intra-op threads (``cores // 4``) for every runner, all cases in ONE gloo group of 4
processes, in alternating rounds.

dapple's schedules: ``dapple`` (1F1B, policy A), ``zbh1`` (ZB-H1, v = 1), ``interleaved``
v = 2 (``interleave(straight, 2)``: chunk c of rank g is virtual stage c*4+g), and ``zbv`` and
``dualpipev`` (the straight plan under ``with_schedule``: the same 8 chunks in a V, rank g
holding chunks g and 7-g), each when the runtime accepts it
(:func:`dapple.runtime.validate_run`; otherwise the row says why). torch's peers:
``Schedule1F1B`` (one stage per rank), ``ScheduleInterleaved1F1B`` and
``ScheduleInterleavedZeroBubble`` (the same 8 chunks, placed as dapple's interleaved plan), and
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (the same 8 chunks in the same V).

Beside each dapple measurement: the simulator's step time (:func:`dapple.simulate.simulate`
with a profile taken as one of 4 co-located workers, with the split backward, and this
machine's ``calibrate(4)``), and the bubble fraction, measured and simulated with the same
definition: ``1 - busy / step``, busy = the wall time a rank spends computing F, B, I and W
(measured: inside the executor's handlers, minus their waits for incoming messages; simulated:
the durations of those events), for the busiest rank and averaged over ranks.

The V schedules are also measured on 2 ranks, with CPU per action kind, by
``schedules_measured_v.py``, whose sections of the report (from its first begin marker to the
end of the file) this script keeps when it rewrites it.

Usage: ``python benchmarks/schedules_measured.py [--rounds 4 --steps 5 --skip 2] [--no-uneven]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (
    BENCH_MODEL,
    HERE,
    WARM_UP,
    bench_transformer,
    header,
    load_note,
    run_worker_group,
)
from _schedules_worker import TORCH_SCHEDULES, worker
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.core.profile import ModelProfile
from dapple.schedule.ir import ActionKind
from dapple.simulate.plan_variants import with_schedule
from vs_torch_pipelining import LR, describe, even_bounds

WORLD = 4
V = 2
"""Chunks per rank of the interleaved schedules."""
COMPUTE = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)


# -- simulation -------------------------------------------------------------------------------
def simulated(plan: Plan, profile: ModelProfile, cluster: Cluster) -> dict[str, float]:
    """Simulated step (ms), bubble fractions (busiest rank, mean over ranks; busy = the
    durations of the F, B, I and W events of each device) and the CPU the model charges per
    step on all devices (the same plan simulated without core sharing: F, B, I, W and OPT
    at their nominal durations, host CPU terms included)."""
    from dapple.simulate import simulate

    res = simulate(plan, profile, cluster)
    busy = dict.fromkeys(plan.devices, 0.0)
    for ev in res.events:
        if ev.action.kind in COMPUTE:
            busy[ev.device] += ev.duration_ms
    alone = simulate(plan, profile, dataclasses.replace(cluster, compute_cores_per_server=None))
    cpu = sum(
        ev.duration_ms
        for ev in alone.events
        if ev.action.kind in COMPUTE or ev.action.kind is ActionKind.STEP
    )
    return {
        "ms": res.step_ms,
        "bubble_max": 1 - max(busy.values()) / res.step_ms,
        "bubble_mean": 1 - statistics.fmean(busy.values()) / res.step_ms,
        "cpu": cpu,
    }


def measured(r: dict[str, Any], skip: int) -> dict[str, Any]:
    """Per round: median step ms after warm-up; bubble fractions per step, then their median."""
    ms = [statistics.median(x[skip:]) for x in r["ms"]]
    cpu = statistics.median(statistics.median(x[skip:]) for x in r["cpu"])
    out: dict[str, Any] = {"rounds": ms, "ms": statistics.median(ms), "cpu": cpu}
    if r["busy"]:
        bmax, bmean = [], []
        for steps_ms, busy in zip(r["ms"], r["busy"], strict=True):
            # per step after warm-up: (step ms, busy ms of each rank)
            per = list(zip(steps_ms, zip(*busy, strict=True), strict=True))[skip:]
            bmax.append(statistics.median(1 - max(b) / s for s, b in per))
            bmean.append(statistics.median(1 - statistics.fmean(b) / s for s, b in per))
        out["bubble_max"], out["bubble_mean"] = statistics.median(bmax), statistics.median(bmean)
    return out


# -- the cases --------------------------------------------------------------------------------
def build_cases(
    blocks: int, G: int, M: int, uneven: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cases to run, dapple rows the runtime refuses: ``{"group", "label", "plan", "why"}``)."""
    from dapple.errors import ValidationError
    from dapple.runtime import validate_run

    wl = bench_transformer(layers=blocks)
    n_layers = wl.num_layers
    b = even_bounds(n_layers, WORLD)
    straight = straight_plan(n_layers, b[:-1], global_batch_size=G, num_micro_batches=M)
    inter = interleave(straight, V)
    grp = f"straight {WORLD} stages {b[1:-1]}"
    dapple_rows: list[tuple[str, str, Plan, str | None]] = [
        (grp, "dapple 1F1B", straight, "1f1b"),
        (grp, "dapple ZB-H1", dataclasses.replace(straight, schedule="zbh1"), "interleavedzb"),
        (grp, f"dapple interleaved v={V}", inter, "interleaved1f1b"),
        (grp, "dapple ZB-V", with_schedule(straight, "zbv"), "zbv"),
        (grp, "dapple DualPipeV", with_schedule(straight, "dualpipev"), "dualpipev"),
    ]
    if uneven:
        reps = [2, 1, 1]
        cuts = [round(n_layers * sum(reps[:k]) / sum(reps)) for k in range(len(reps))]
        p211 = straight_plan(
            n_layers, cuts, global_batch_size=G, num_micro_batches=M, replicas=reps
        )
        g211 = f"2:1:1 {cuts[1:]}"
        dapple_rows += [
            (g211, "dapple 1F1B", p211, None),
            (g211, "dapple ZB-H1", dataclasses.replace(p211, schedule="zbh1"), None),
        ]
    cases: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for g, label, plan, peer in dapple_rows:
        row = {"group": g, "label": label, "runner": "dapple", "plan": plan.to_dict(), "peer": peer}
        try:
            validate_run(plan, wl, WORLD)
        except ValidationError as e:
            refused.append({**row, "why": str(e).strip().splitlines()[0]})
            continue
        cases.append(row)
    chunks = [list(st.layers) for st in inter.stages]  # virtual stage c*4+g: chunk c of rank g
    S = len(chunks)
    loop = [k % WORLD for k in range(S)]
    vee = [k if k < WORLD else S - 1 - k for k in range(S)]
    for kind, ch, place in (
        ("1f1b", [list(st.layers) for st in straight.stages], list(range(WORLD))),
        ("interleaved1f1b", chunks, loop),
        ("interleavedzb", chunks, loop),
        ("zbv", chunks, vee),
        ("dualpipev", chunks, vee),
    ):
        cases.append(
            {
                "group": grp,
                "label": f"torch {TORCH_SCHEDULES[kind]}",
                "runner": "torch",
                "kind": kind,
                "chunks": ch,
                "placement": place,
            }
        )
    return cases, refused


def _placement(c: dict[str, Any]) -> str:
    per = [[k for k, r in enumerate(c["placement"]) if r == g] for g in range(WORLD)]
    return "; ".join(
        f"r{g}: " + "+".join(f"{c['chunks'][k][0]}-{c['chunks'][k][1]}" for k in ks)
        for g, ks in enumerate(per)
    )


def split_cost(blocks: int, lo: int, hi: int, b: int, repeats: int = 15) -> tuple[float, float]:
    """CPU ms (median, one process, one thread) of one micro-batch of layers ``[lo, hi)``:
    forward + whole backward, and forward + the runtime's split backward (I then W, torch's
    halves: :mod:`dapple.models.split_backward`)."""
    from dapple.models.split_backward import input_gradients, weight_gradients

    wl = bench_transformer(layers=blocks)
    mod = wl.build_stage(lo, hi, 0)
    weights = list(mod.parameters())
    x = torch.randn(b, BENCH_MODEL["seq"], BENCH_MODEL["hidden"])

    def whole() -> None:
        xi = x.clone().requires_grad_(True)
        out = mod(xi)
        torch.autograd.backward([out], [torch.ones_like(out)])

    def split() -> None:
        xi = x.clone().requires_grad_(True)
        out = mod(xi).clone()  # as the runtime: an output no autograd node saves
        weight_gradients(input_gradients([out], [torch.ones_like(out)], [xi], weights), weights)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times: dict[Callable[[], None], list[float]] = {whole: [], split: []}
        for _ in range(repeats + 3):  # alternating, the first 3 of each dropped
            for fn, ts in times.items():
                t = time.process_time()
                fn()
                ts.append((time.process_time() - t) * 1e3)
                mod.zero_grad(set_to_none=True)
        return statistics.median(times[whole][3:]), statistics.median(times[split][3:])
    finally:
        torch.set_num_threads(threads)


def _split_cost_note(
    cases: list[dict[str, Any]],
    dapple_rows: list[dict[str, Any]],
    meas: dict[str, dict[str, Any]],
    sims: dict[str, dict[str, float]],
) -> list[str]:
    """Lines comparing the CPU per step of the split backward with the whole one (measured
    for dapple and torch, and what the simulator charges)."""

    def k(label: str, group: str) -> str:
        return label + "|" + group

    out = []
    for grp in dict.fromkeys(c["group"] for c in dapple_rows):
        one, zb = k("dapple 1F1B", grp), k("dapple ZB-H1", grp)
        if one in meas and zb in meas:
            out.append(
                f"- CPU of the split backward ({grp}): dapple ZB-H1 used "
                f"{meas[zb]['cpu'] / meas[one]['cpu'] - 1:+.0%} CPU per step (all ranks) over "
                f"dapple 1F1B; the simulator charges {sims[zb]['cpu'] / sims[one]['cpu'] - 1:+.0%} "
                "(I and W profiled with the runtime's split)."
            )
    grp = next((c["group"] for c in cases if c["runner"] == "torch"), "")
    one, zb = k("torch Schedule1F1B", grp), k("torch ScheduleInterleavedZeroBubble", grp)
    if one in meas and zb in meas:
        out.append(
            f"- torch, same partition: ScheduleInterleavedZeroBubble used "
            f"{meas[zb]['cpu'] / meas[one]['cpu'] - 1:+.0%} CPU per step over Schedule1F1B."
        )
    return out


def _v_section(md: Path) -> str:
    """What ``md`` holds from the first section ``schedules_measured_v.py`` wrote into it (its
    begin marker) to its end - that section, the later ones and the readings written beside
    them, earlier runs of this report included - kept when this script rewrites the file; ""
    when there is none."""
    from schedules_measured_v import BEGIN

    text = md.read_text() if md.exists() else ""
    if BEGIN not in text:
        return ""
    return "\n" + BEGIN + text.split(BEGIN, 1)[1].rstrip("\n") + "\n"


def _pct(x: float) -> str:
    return f"{x:.0%}"


def main(argv: list[str] | None = None) -> int:
    from dapple.calibrate.machine import calibrate, runtime_threads
    from dapple.profiler.measure import profile_workload

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=5, help="steps per case per round")
    ap.add_argument("--skip", type=int, default=WARM_UP, help="warm-up steps dropped per round")
    ap.add_argument("--blocks", type=int, default=14, help="transformer blocks (+2 layers)")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="profiler repeats per layer")
    ap.add_argument("--no-uneven", action="store_true", help="skip the 2:1:1 partition")
    ap.add_argument("--out", default=str(HERE / "schedules_measured.md"))
    args = ap.parse_args(argv)
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python benchmarks/schedules_measured.py {args_text}".strip()
    lines = header(
        "Schedules measured: 1F1B / interleaved / ZB-H1 / ZB-V / DualPipeV vs the simulator and "
        "torch (CPU, gloo)",
        command,
    )
    G, M, skip = args.global_batch, args.micro_batches, args.skip
    if M % WORLD or G % M or M < 2 * WORLD:
        raise SystemExit(
            f"need M a multiple of {WORLD} dividing G and >= {2 * WORLD} (DualPipeV), got G={G} M={M}"
        )
    wl = bench_transformer(layers=args.blocks)
    n_layers = wl.num_layers
    t0 = time.perf_counter()
    cases, refused = build_cases(args.blocks, G, M, not args.no_uneven)
    # the simulator's inputs: a profile as one of 4 co-located workers, with the split
    # backward (ZB-H1's I and W), at the slice sizes the plans run; this machine's calibrate(4)
    sizes = sorted({G // M, G // M // 2} - {0})
    threads = runtime_threads(WORLD)
    profile = profile_workload(
        wl, sizes, repeats=args.repeats, num_threads=threads, co_workers=WORLD, split_backward=True
    )
    cluster = calibrate(WORLD).cluster
    prep_s = time.perf_counter() - t0
    print(f"profile + calibrate: {prep_s:.0f} s", flush=True)
    mid = even_bounds(n_layers, WORLD)[1:3]  # stage 1 of the straight pipeline: blocks only
    fb_ms, fiw_ms = split_cost(args.blocks, mid[0], mid[1], G // M)
    opts = {
        "rounds": args.rounds,
        "steps": args.steps,
        "skip": skip,
        "blocks": args.blocks,
        "G": G,
        "M": M,
    }
    t1 = time.perf_counter()
    got = run_worker_group(worker, WORLD, cases, opts)
    run_s = time.perf_counter() - t1
    results = {c["label"] + "|" + c["group"]: got[str(i)] for i, c in enumerate(cases)}

    def key(c: dict[str, Any]) -> str:
        return str(c["label"]) + "|" + str(c["group"])

    meas = {key(c): measured(results[key(c)], skip) for c in cases if not results[key(c)]["error"]}
    lines += [
        f"Model: zoo `transformer` {{**{BENCH_MODEL}, 'layers': {args.blocks}}} ({n_layers} "
        f"chain layers: embedding, {args.blocks} blocks, LM head), global batch {G}, M = {M} "
        f"(micro-batch {G // M}), plain SGD lr {LR}, {WORLD} gloo processes with {threads} "
        f"intra-op thread(s) each. All cases run in ONE process group, {args.rounds} rounds x "
        f"{args.steps} steps per case, the round order alternating; the first {skip} step(s) of "
        "each round dropped; ms/step = median over rounds of each round's median. Step time = "
        "the slowest rank's period between consecutive step ends, steps back to back (dapple: "
        "between its `run_step` ends). dapple / torch = median over "
        "rounds of the paired ratio (torch ms / dapple ms in the same round), with its range.",
        "",
        "Simulator: `simulate(plan, profile, cluster)` with `profile_workload(batch_sizes="
        f"{sizes}, repeats={args.repeats}, num_threads={threads}, co_workers={WORLD}, "
        "split_backward=True)` (CPU time of each layer while 3 forked processes train the "
        f"model; ZB-H1's I and W each timed with the runtime's split, torch's halves) and `calibrate({WORLD})` "
        f"({cluster.intra_server_bandwidth_gbps:.2f} Gbps, latency "
        f"{cluster.intra_server_latency_ms:.3f} ms, c = {cluster.compute_cores_per_server or 0:.2f}"
        f" compute units, E = {cluster.background_load_per_server:.2f}, host CPU "
        f"{cluster.action_overhead_ms:.3f} ms/action + {cluster.step_overhead_ms:.2f} ms/step + "
        f"{cluster.comm_cpu_ms_per_mb:.3f} ms/MiB). Profile + calibration took {prep_s:.0f} s, "
        f"the measurements {run_s:.0f} s.",
        "",
        "**Bubble fraction**, the same definition on both sides: `1 - busy / step`, where busy is "
        "the wall time a rank spends computing F, B, I and W in one step. Measured: time inside "
        "the runtime's `StageExecutor.forward/backward/backward_input/backward_weight` handlers "
        "minus their waits for incoming activations or gradients (`StageLinks.wait_concat`), per rank and "
        "step (wrapped in the benchmark's workers, `src/` unchanged), over rank 0's step period; "
        "median over steps, then over rounds. Simulated: the durations of the F, B, I and W "
        "events of each device over the simulated step. Not counted as busy on either side: "
        "the AllReduce and optimizer step, sends, receives. *busiest* uses the rank with the "
        "most busy time (1 - its share: the step's slack over the critical rank); *mean* "
        "averages the busy time over the 4 ranks (the idle share of all device time). With 4 "
        "processes on 2 cores a computing rank's wall time includes its time-sliced share, so "
        "these are shares of wall time, not of CPU.",
        "",
        "**CPU ms/step**: the CPU time of all 4 processes (every thread, `time.process_time`) "
        "per step, summed over ranks, median after warm-up (dapple: inside `run_step`; torch: "
        "inside `schedule.step` + optimizer step). Simulated: what the model charges, the F, B, "
        "I, W and OPT durations of the same plan simulated without core sharing (profiled "
        "layer CPU + the calibrated host CPU per action, per step and per MiB). On 2 cores a "
        "step can take no less than this CPU / 2 (here c = "
        f"{cluster.compute_cores_per_server or 0:.2f} compute units).",
        "",
        "## dapple's schedules: measured vs simulated",
        "",
        "| partition | schedule (plan) | measured ms/step | samples/s | simulated ms | "
        "measured / simulated | bubble busiest: measured / simulated | bubble mean: measured "
        "/ simulated | CPU ms/step (4 ranks): measured / simulated | speed vs 1F1B: measured "
        "[range] / simulated |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dapple_rows = [c for c in cases if c["runner"] == "dapple"] + refused
    dapple_rows.sort(key=lambda c: (c["group"].startswith("2:1:1"), c["label"]))
    sims = {key(c): simulated(Plan.from_dict(c["plan"]), profile, cluster) for c in dapple_rows}
    for c in dapple_rows:
        plan = Plan.from_dict(c["plan"])
        sim = sims[key(c)]
        name = f"{c['label']} ({describe(plan)})"
        # speed relative to dapple 1F1B on the same partition (1F1B ms / this ms)
        ref = next(
            x for x in dapple_rows if x["group"] == c["group"] and x["label"] == "dapple 1F1B"
        )
        sim_b = (
            _pct(sim["bubble_max"]),
            _pct(sim["bubble_mean"]),
            f"{sim['cpu']:.0f}",
            f"{sims[key(ref)]['ms'] / sim['ms']:.2f}x",
        )
        err = c.get("why") or results[key(c)]["error"]
        if err:
            lines.append(
                f"| {c['group']} | {name} | not run: {err} | - | {sim['ms']:.1f} | - | "
                f"- / {sim_b[0]} | - / {sim_b[1]} | - / {sim_b[2]} | - / {sim_b[3]} |"
            )
            continue
        m = meas[key(c)]
        vs = "-"
        if key(ref) in meas:
            paired = [a / b for a, b in zip(meas[key(ref)]["rounds"], m["rounds"], strict=True)]
            vs = f"{statistics.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}]"
        lines.append(
            f"| {c['group']} | {name} | {m['ms']:.1f} | {G / m['ms'] * 1e3:.1f} | "
            f"{sim['ms']:.1f} | {m['ms'] / sim['ms']:.2f} | "
            f"{_pct(m['bubble_max'])} / {sim_b[0]} | {_pct(m['bubble_mean'])} / {sim_b[1]} | "
            f"{m['cpu']:.0f} / {sim_b[2]} | {vs} / {sim_b[3]} |"
        )
    lines += [
        "",
        "## dapple vs torch.distributed.pipelining on the same partition",
        "",
        "| torch schedule | stages per rank (layers) | ms/step | samples/s | CPU ms/step (4 "
        "ranks) | dapple counterpart | dapple / torch [range over rounds] |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    by_peer = {c["peer"]: c for c in dapple_rows if c.get("peer")}
    verdicts: list[str] = []
    for c in (c for c in cases if c["runner"] == "torch"):
        err = results[key(c)]["error"]
        counterpart = by_peer.get(c["kind"])
        cp = counterpart["label"] if counterpart else "-"
        if err:
            lines.append(f"| {c['label']} | {_placement(c)} | not run: {err} | - | - | {cp} | - |")
            verdicts.append(f"- {c['label']}: not run ({err}).")
            continue
        m = meas[key(c)]
        ratio_cell = "-"
        if counterpart is not None and "why" in counterpart:
            ratio_cell = "dapple not run"
            verdicts.append(
                f"- {counterpart['label']} vs {c['label']} (goal >= 1.0x): **not measured** "
                f"(dapple's runtime refused the plan: {counterpart['why']})."
            )
        elif counterpart is not None and not results[key(counterpart)]["error"]:
            d = meas[key(counterpart)]
            paired = [t / x for t, x in zip(m["rounds"], d["rounds"], strict=True)]
            r = statistics.median(paired)
            ratio_cell = f"**{r:.2f}x** [{min(paired):.2f}-{max(paired):.2f}]"
            verdicts.append(
                f"- {counterpart['label']} vs {c['label']} (goal >= 1.0x): "
                f"**{'met' if r >= 1.0 else 'missed'}** ({r:.3f}x, rounds "
                f"{min(paired):.2f}-{max(paired):.2f}x; {d['ms']:.1f} vs {m['ms']:.1f} ms)."
            )
        lines.append(
            f"| {c['label']} | {_placement(c)} | {m['ms']:.1f} | {G / m['ms'] * 1e3:.1f} | "
            f"{m['cpu']:.0f} | {cp} | {ratio_cell} |"
        )
    lines += [
        "",
        f"Pairs: dapple 1F1B vs `Schedule1F1B`; dapple interleaved v={V} vs "
        "`ScheduleInterleaved1F1B`; dapple ZB-V vs `ScheduleZBVZeroBubble` and dapple DualPipeV "
        "vs `ScheduleDualPipeV` (the same chunks in the same V: rank g holds chunks g and 7-g, "
        "so rank 0 holds both the embedding and the LM head); dapple ZB-H1 vs "
        "`ScheduleInterleavedZeroBubble`, **not the same schedule**: dapple's ZB-H1 keeps one "
        f"stage per rank (v = 1, the 1F1B memory bound), torch's runs v = {V} chunks per rank "
        "(its ZB1P, interleaved); torch has no ZB-H1 with one stage per rank.",
        "",
        "## Verdicts",
        "",
        *verdicts,
        *_split_cost_note(cases, dapple_rows, meas, sims),
        f"- Alone (one process, one thread, CPU time, median of 15): layers {mid[0]}-{mid[1]} "
        f"(stage 1 of the straight pipeline) at micro-batch {G // M}: forward + backward "
        f"{fb_ms:.1f} ms, forward + I + W with torch's halves {fiw_ms:.1f} ms "
        f"({fiw_ms / fb_ms - 1:+.0%}).",
        "",
        f"End: {load_note()}.",
        "",
    ]
    out = Path(args.out)
    text = "\n".join(lines)
    out.write_text(text + _v_section(out))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
