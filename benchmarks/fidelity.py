"""Fidelity: the planner's L and the simulator's step time vs the measured step time (CPU).

One model (:data:`_bench_common.BENCH_MODEL`) on 4 local CPU processes; the profile is measured
the way the runtime runs (usable cores // 4 intra-op threads, and as one of 4 co-located
workers: ``co_workers=4``, CPU time of the profiling thread) and the cluster is this machine's ``calibrate(4)`` (links, core
sharing and the runtime's host CPU overheads). For each replication (DP, 1:1:1:1, 3:1, 1:3, 2:1:1, 2:2) and schedule (DAPPLE
1F1B policy A, GPipe) the layer cuts are the ones minimising the cost model's L for that
replication (what the planner would pick), then: L (``pipeline_latency``), the simulated step
(``simulate``) and the measured step (``dapple.runtime.train``, median after warm-up, each worker
in a session of its own as dapple's launcher starts them), the
relative error of each prediction and the Spearman rank correlation between predicted and
measured order. Plans run in alternating order over rounds so load drifts hit all of them.

Every input (both profiles, the calibrated cluster, the plans, the measured step times and
load sweeps) is saved beside the report as ``<report>.inputs.json``; ``--replay`` re-predicts a
saved run with this checkout's cost model, so a run on another machine can be judged again
offline after a change to the model.

Usage: ``python benchmarks/fidelity.py [--rounds 3 --chunk 3 --skip 1]``;
``python benchmarks/fidelity.py --replay fidelity.inputs.json --out fidelity-replay.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (
    BENCH_MODEL,
    HERE,
    bench_transformer,
    header,
    join_worker_group,
    load_note,
    run_worker_group,
    spearman,
)
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.simulate import simulate

REPLICATIONS: tuple[tuple[int, ...], ...] = ((4,), (1, 1, 1, 1), (3, 1), (1, 3), (2, 1, 1), (2, 2))
"""Replica counts per stage of the plans compared (4 devices each)."""


def best_cuts(
    profile: ModelProfile,
    cluster: Cluster,
    reps: tuple[int, ...],
    G: int,
    M: int,
    schedule: str,
) -> Plan:
    """The plan with replication ``reps`` whose layer cuts minimise the cost model's L."""
    n = profile.num_layers
    best: tuple[float, Plan] | None = None
    for inner in itertools.combinations(range(1, n), len(reps) - 1):
        plan = straight_plan(
            n,
            [0, *inner],
            global_batch_size=G,
            num_micro_batches=M,
            replicas=list(reps),
            schedule=schedule,
            model_name=profile.model_name,
        )
        L = pipeline_latency(plan, profile, cluster).L_ms
        if best is None or best[0] > L:
            best = (L, plan)
    assert best is not None
    return best[1]


def _group_worker(
    rank: int, world: int, port: int, plans: list[dict[str, Any]], opts: dict[str, Any], out: str
) -> None:
    from dapple.calibrate.machine import busy_sweep_clocks
    from dapple.runtime import TrainConfig, run_plan, shutdown_distributed

    # as dapple's launcher starts a worker: a session of its own (one CPU share under
    # sched_autogroup, as the calibration's workers), cores // world intra-op threads
    join_worker_group(rank, world, port)
    wl = bench_transformer()
    times: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    shared: dict[int, list[list[float]]] = {i: [] for i in range(len(plans))}
    shared_cpu: dict[int, list[list[float]]] = {i: [] for i in range(len(plans))}
    for rnd in range(opts["rounds"]):
        # rotate and alternate the order so a load spike at a round boundary does not hit the
        # same plans in every round
        n = len(plans)
        order = [(i + rnd * (n // 3 + 1)) % n for i in range(n)][:: -1 if rnd % 2 else 1]
        for i in order:
            # the compute share right now: the calibration matmul with k = 1 .. 4 ranks busy,
            # in wall and CPU time
            wall, cpu = busy_sweep_clocks(rank, world)
            shared[i].append(wall)
            shared_cpu[i].append(cpu)
            cfg = TrainConfig(steps=opts["chunk"], seed=rnd, optimizer="sgd", device="cpu")
            run = run_plan(Plan.from_dict(plans[i]), wl, cfg, device=torch.device("cpu"))
            kept = [m.step_ms for m in run.metrics][opts["skip"] :]
            if rank == 0:
                med = statistics.median(kept)
                times[i].append(med)
                print(
                    f"  round {rnd} {plans[i]['stages'] and label(Plan.from_dict(plans[i])):34s} "
                    f"{med:8.1f} ms ({load_note()})",
                    flush=True,
                )
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "shared": shared, "cpu": shared_cpu}))
    shutdown_distributed()


def measure_group(
    plans: list[Plan], opts: dict[str, Any]
) -> tuple[list[list[float]], list[list[list[float]]], list[list[list[float]]]]:
    """Per-round median step times (ms) of every plan, interleaved in ONE 4-process gloo group,
    and the matmul's wall and CPU times (ms) with k = 1 .. 4 ranks busy (``busy_sweep_clocks``)
    right before each chunk."""
    got = run_worker_group(_group_worker, 4, [p.to_dict() for p in plans], opts)
    n = len(plans)
    return (
        [got["times"][str(i)] for i in range(n)],
        [got["shared"][str(i)] for i in range(n)],
        [got["cpu"][str(i)] for i in range(n)],
    )


def label(plan: Plan) -> str:
    reps = ":".join(str(s.replicas) for s in plan.stages)
    cuts = "|".join(str(s.layers[1]) for s in plan.stages[:-1])
    sched = "-" if plan.num_stages == 1 else plan.schedule
    return f"{reps} cut {cuts or '-'} M={plan.num_micro_batches} {sched}"


def _row_stats(pred: list[float], meas: list[float]) -> tuple[list[float], float]:
    errs = [(a - m) / m for a, m in zip(pred, meas, strict=True)]
    return errs, spearman(pred, meas)


def _goal_cells(errs: list[float], rho: float) -> tuple[str, str]:
    n = len(errs)
    ok = sum(abs(e) <= 0.10 for e in errs)
    ok25 = sum(abs(e) <= 0.25 for e in errs)
    absd = [abs(e) for e in errs]
    err_cell = (
        f"{ok}/{n} plans ({ok25}/{n}; max {max(absd):.0%}, median "
        f"{statistics.median(absd):.0%}) - {'met' if ok == n else 'missed'}"
    )
    return err_cell, f"{rho:.2f} - {'met' if rho >= 0.9 else 'missed'}"


def _drift_note(cpu_sweeps: bool, alone_ms: float) -> list[str]:
    """The paragraph on the in-run columns: what is re-measured before each chunk."""
    lone = (
        "W = the k = 1 time in wall over CPU ms (a lone worker's wall ms per CPU ms then)"
        if cpu_sweeps
        else "`compute_slowdown` = the k = 1 time over the same matmul timed alone right after "
        f"profiling ({alone_ms:.2f} ms): a lone worker's speed then vs at profile time"
    )
    return [
        "Load drift correction (columns *in-run*): other programs' load changes during the "
        "run, so right before every measured chunk the calibration matmul is timed with k = 1 "
        "..4 ranks computing at once (`busy_sweep_clocks`) and the sharing (c, E) is re-fitted "
        f"(`fit_sharing`), and {lone}; each chunk is predicted with its own values; same "
        "profile, links and host terms; median over rounds; *in-run W*: its median per plan",
    ]


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Profile, calibrate and measure on this machine: every input of :func:`report`."""
    from dapple.calibrate.machine import _matmul_alone_ms, calibrate, runtime_threads
    from dapple.host.cpu_cores import usable_cores
    from dapple.profiler.measure import profile_workload

    G, M, nproc = args.global_batch, args.micro_batches, 4
    threads = runtime_threads(nproc)  # the runtime's per-worker count, the calibration's too
    wl = bench_transformer()
    t0 = time.perf_counter()
    # the model: CPU time of each layer as one of 4 co-located workers (profile_workload's
    # co_workers), shared cores and host CPU overheads from calibrate
    profile = profile_workload(wl, [1, 2, 4, 8], repeats=9, num_threads=threads, co_workers=nproc,
                               passes=args.profile_passes)  # fmt: skip
    # the earlier models: wall time of each layer alone
    wall_profile = profile_workload(wl, [1, 2, 4, 8], repeats=9, num_threads=threads)
    alone_ms = _matmul_alone_ms(nproc)  # the calibration matmul alone, right after profiling
    cal = calibrate(nproc)
    cluster = cal.cluster
    prep_s = time.perf_counter() - t0
    plans: list[Plan] = []
    for reps in REPLICATIONS:
        for sched in ("dapple", "gpipe") if len(reps) > 1 else ("dapple",):
            plans.append(best_cuts(profile, cluster, reps, G, 1 if len(reps) == 1 else M, sched))
    opts = {"rounds": args.rounds, "chunk": args.chunk, "skip": args.skip, "threads": threads}
    times, shared, shared_cpu = measure_group(plans, opts)
    return {
        "args": {
            k: getattr(args, k)
            for k in ("rounds", "chunk", "skip", "global_batch", "micro_batches", "profile_passes")
        },
        "threads": threads,
        "usable_cores": usable_cores(),
        "profile": profile.to_dict(),
        "wall_profile": wall_profile.to_dict(),
        "cluster": cluster.to_dict(),
        "matmul_alone_ms": alone_ms,
        "calibration_matmul_ms": [cal.matmul_alone_ms, cal.matmul_shared_ms],
        "prep_s": prep_s,
        "plans": [p.to_dict() for p in plans],
        "times": times,
        "shared": shared,
        "shared_cpu": shared_cpu,
    }


def report(inp: dict[str, Any]) -> list[str]:
    """The fidelity tables from :func:`collect`'s inputs, predicted by this checkout's model."""
    from dapple.calibrate.compute_share import fit_sharing, lone_wall_per_cpu

    a = inp["args"]
    G, M, threads = a["global_batch"], a["micro_batches"], inp["threads"]
    profile = ModelProfile.from_dict(inp["profile"])
    wall_profile = ModelProfile.from_dict(inp["wall_profile"])
    cluster = Cluster.from_dict(inp["cluster"])
    plans = [Plan.from_dict(p) for p in inp["plans"]]
    times, shared = inp["times"], inp["shared"]
    shared_cpu = inp.get("shared_cpu")  # the sweeps' CPU times (none in runs before them)
    alone_ms, prep_s = inp["matmul_alone_ms"], inp["prep_s"]
    cal_alone, cal_shared = inp["calibration_matmul_ms"]
    meas = [statistics.median(t) for t in times]
    L = [pipeline_latency(p, profile, cluster).L_ms for p in plans]
    sim = [simulate(p, profile, cluster).step_ms for p in plans]
    # the model without a lone worker's wall per CPU ms (W = 1): what it charged before W
    no_w = dataclasses.replace(cluster, lone_wall_per_cpu=1.0)
    L_no_w = [pipeline_latency(p, profile, no_w).L_ms for p in plans]

    def at(i: int, r: int) -> Cluster:
        # the sharing (c, E) fitted to the sweep measured right before the chunk, and a lone
        # worker's speed then: W of the same sweep (wall over CPU ms at k = 1), or in runs
        # without CPU times the k = 1 wall time over the matmul's wall time after profiling
        sweep = shared[i][r]
        c, e = fit_sharing(sweep, inp["usable_cores"] / threads)
        if shared_cpu is None:
            slowdown, lone = sweep[0] / alone_ms, cluster.lone_wall_per_cpu
        else:
            slowdown, lone = cluster.compute_slowdown, lone_wall_per_cpu(sweep, shared_cpu[i][r])
        return dataclasses.replace(
            cluster,
            compute_cores_per_server=c,
            background_load_per_server=e,
            compute_slowdown=slowdown,
            lone_wall_per_cpu=lone,
        )

    fitted = [[at(i, r) for r in range(len(shared[i]))] for i in range(len(plans))]
    every = [c for row in fitted for c in row]

    # the older models, on the wall-time profile and without host overheads: (1) one all-busy
    # slowdown for every compute, no sharing; (2) processor sharing of (c, E)
    no_host = dataclasses.replace(
        cluster, action_overhead_ms=0.0, step_overhead_ms=0.0, comm_cpu_ms_per_mb=0.0
    )
    flat = dataclasses.replace(
        no_host,
        compute_cores_per_server=None,
        compute_slowdown=max(1.0, cal_shared / cal_alone),
    )
    L_flat = [pipeline_latency(p, wall_profile, flat).L_ms for p in plans]
    sim_share = [simulate(p, wall_profile, no_host).step_ms for p in plans]

    # per plan: median over rounds of the prediction with the slowdown measured right before
    L2 = [
        statistics.median(pipeline_latency(p, profile, c).L_ms for c in fitted[i])
        for i, p in enumerate(plans)
    ]
    sim2 = [
        statistics.median(simulate(p, profile, c).step_ms for c in fitted[i])
        for i, p in enumerate(plans)
    ]
    caps = [c.compute_cores_per_server or 0.0 for c in every]
    lone = [c.compute_slowdown if shared_cpu is None else c.lone_wall_per_cpu for c in every]
    loads = [c.background_load_per_server for c in every]
    w_plan = [statistics.median(c.lone_wall_per_cpu for c in row) for row in fitted]
    lines = [
        f"Model: zoo `transformer` {BENCH_MODEL}, global batch {G}, M = {M} for pipelines "
        f"(M = 1 for DP), 4 CPU processes with {threads} intra-op thread(s) each (the runtime's "
        f"usable cores // 4; {inp['usable_cores']} usable cores). Layer cuts per replication: "
        "the ones minimising L of this model.",
        "",
        "The model (columns L and simulated): profile `profile_workload(batch_sizes=[1, 2, 4, "
        f"8], repeats=9, num_threads={threads}, co_workers=4, "
        f"passes={a.get('profile_passes', 1)})` - each layer's CPU time (of the "
        "profiling thread) while 3 other "
        "processes train the model, so the slow-down co-located workers cause each other "
        "beyond time-slicing (caches, memory bandwidth; largest at small batches) is in the "
        "profile. Cluster `calibrate(4)`: links "
        f"{cluster.intra_server_bandwidth_gbps:.2f} Gbps, latency "
        f"{cluster.intra_server_latency_ms:.3f} ms; time-slicing c = "
        f"{cluster.compute_cores_per_server or 0:.2f} compute units, E = "
        f"{cluster.background_load_per_server:.2f} (k workers computing at once each run at "
        "min(1, c / (k + E)) / min(1, c / (1 + E))); the runtime's host CPU (`dapple."
        f"overheads`, measured by running the runtime on a tiny MLP): "
        f"{cluster.action_overhead_ms:.3f} ms per action, {cluster.step_overhead_ms:.2f} ms "
        f"per step, {cluster.comm_cpu_ms_per_mb:.3f} ms per MiB sent or received, shared like "
        "compute (`dapple.cost.host`). Earlier models, for comparison, on the wall-time "
        "profile taken alone and without host CPU: *old* - no sharing, every compute x "
        f"{flat.compute_slowdown:.2f} (the all-busy matmul slowdown); *sharing* - the simulator "
        f"with (c, E) only. Profiling (both) + calibration took {prep_s:.0f} s.",
        "",
        "Measured: all plans in ONE 4-process gloo group, interleaved "
        f"({a['rounds']} rounds x {a['chunk']} steps per plan, order rotated and alternating, "
        f"first {a['skip']} step(s) of each chunk dropped); measured = median over rounds of "
        "each round's median step time (the period between consecutive step collectives).",
        "",
        "A lone worker's wall ms per CPU ms W (`Cluster.lone_wall_per_cpu`, the calibration's "
        f"k = 1 matmul in both clocks): {cluster.lone_wall_per_cpu:.2f} at calibration; it turns "
        "the CPU-time profile and host terms into wall time (`dapple.cost.cpu_clock`). Column "
        "*L, W = 1*: the same cluster without it (the model before W).",
        "",
        *_drift_note(shared_cpu is not None, alone_ms),
        "(in-run " + ("slowdown" if shared_cpu is None else "W") + ": min "
        f"{min(lone):.2f}, median {statistics.median(lone):.2f}, max {max(lone):.2f}; c: min "
        f"{min(caps):.2f}, median {statistics.median(caps):.2f}, max {max(caps):.2f}; E: min "
        f"{min(loads):.2f}, median {statistics.median(loads):.2f}, max {max(loads):.2f}).",
        "",
        "| plan (replicas, cuts, M, schedule) | measured ms | old L ms (err) | sharing sim ms "
        "(err) | L, W = 1 ms (err) | L ms (err) | simulated ms (err) | L in-run ms (err) "
        "| sim in-run ms (err) | in-run W |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cols = [L_flat, sim_share, L_no_w, L, sim, L2, sim2]
    stats = [_row_stats(c, meas) for c in cols]
    for i, p in enumerate(plans):
        cells = " | ".join(
            f"{c[i]:.1f} ({st[0][i]:+.0%})" for c, st in zip(cols, stats, strict=True)
        )
        lines.append(f"| {label(p)} | {meas[i]:.1f} | {cells} | {w_plan[i]:.2f} |")
    goal = [_goal_cells(*st) for st in stats]
    spread = max(max(t) / min(t) for t in times)
    lines += [
        "",
        "| goal | old L | sharing sim | L, W = 1 | L | simulator | L, in-run capacity "
        "| simulator, in-run capacity |",
        "|---|---|---|---|---|---|---|---|",
        "| abs error <= 10% of measured (within 25%) | " + " | ".join(g[0] for g in goal) + " |",
        "| Spearman rank correlation >= 0.9 | " + " | ".join(g[1] for g in goal) + " |",
        "",
        f"Spread of the per-round medians (max/min, worst plan): {spread:.2f}x; per plan: "
        + ", ".join(f"{max(t) / min(t):.2f}" for t in times)
        + ".",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--chunk", type=int, default=3, help="steps per plan per round")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps dropped per chunk")
    ap.add_argument(
        "--profile-passes",
        type=int,
        default=1,
        help="co-worker profile passes, per layer the median one (profile_workload)",
    )
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--out", default=str(HERE / "fidelity.md"))
    ap.add_argument(
        "--replay",
        metavar="INPUTS_JSON",
        help="re-predict a saved run (its *.inputs.json) with this checkout's cost model, "
        "measuring nothing",
    )
    args = ap.parse_args(argv)
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python benchmarks/fidelity.py {args_text}".strip()
    out = Path(args.out)
    if args.replay:
        inp = json.loads(Path(args.replay).read_text())
        lines = [
            *inp["header"][:-1],
            f"- replayed: `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
            " - the measured columns and every input are the saved run's; the predictions are "
            "this checkout's",
            "",
            *report(inp),
            f"End of the measured run: {inp['end_load']}.",
            "",
        ]
    else:
        title = "Fidelity: predicted (planner L, simulator) vs measured step time"
        inp = {"header": header(title, command), **collect(args), "end_load": load_note()}
        saved = out.with_suffix(".inputs.json")
        saved.write_text(json.dumps(inp, indent=1))
        lines = [
            *inp["header"],
            *report(inp),
            f"End: {inp['end_load']}.",
            "",
            f"Inputs (profiles, calibration, cluster, plans, measured times and sweeps): "
            f"`{saved.name}`; `python benchmarks/fidelity.py --replay {saved.name}` re-predicts "
            "them offline.",
            "",
        ]
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
