"""MoE fidelity on this CPU: a tiny Hugging Face Mixtral's predicted step (L, simulator) against
the measured one, with and without expert parallelism, in ONE interleaved gloo group, and each
rank's step taken apart by action (F, B, sends, receives, AR, OPT) and by the expert exchange
inside them (the all-to-alls, the route table's all-gather, the experts' AllReduce).

The method is :mod:`fidelity`'s (the one that works for dense plans on this machine): the
profile is each layer's CPU time as one of 4 co-located workers (``co_workers=4``, with the MoE
blocks' router, experts and expert load measured apart, as ``dapple profile`` does), the
cluster is this machine's ``calibrate(4)`` (links, core sharing (c, E), host CPU terms), and
right before every measured chunk the sharing is re-fitted (``busy_sweep``, ``fit_sharing``):
the *in-run* columns predict each chunk with its own values.

Plans (global batch :data:`BATCH`, M = 1, 4 processes): the planner's 1:2 cut of ``moe_cpu.md``
(``[0,3) 1; [3,6) 2``) at e_s = 1 and 2, and pure data parallelism (``[0,6) 4``) at e_s = 1,
2 and 4. Measured: median over rounds of each chunk's median step after ``--skip`` steps.

Every input is saved beside the report (``<report>.inputs.json``); ``--replay`` re-predicts a
saved run with this checkout's cost model, measuring nothing.

Usage: ``python benchmarks/moe_fidelity.py [--rounds 5 --chunk 4 --skip 1] --out REPORT.md``;
``python benchmarks/moe_fidelity.py --replay REPORT.inputs.json --out REPLAY.md``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import header, join_worker_group, load_note, run_worker_group, spearman
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.moe import expert_alltoall_ms, expert_group_shapes
from dapple.cost.pipeline import pipeline_latency
from dapple.simulate import simulate

CONFIG: dict[str, Any] = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                              max_position_embeddings=64, num_local_experts=8,
                              num_experts_per_tok=2)  # fmt: skip
"""The tiny Mixtral of ``moe_cpu.md``: 4 blocks of 8 experts (top-2)."""
BATCH = 16
"""Global batch (samples per step)."""
LAYOUTS: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = (
    ((0, 3), (1, 2), (1, 1)),
    ((0, 3), (1, 2), (1, 2)),
    ((0,), (4,), (1,)),
    ((0,), (4,), (2,)),
    ((0,), (4,), (4,)),
)
"""``(stage starts, replicas, expert widths)`` of the plans compared."""
KINDS = ("F", "B", "RECV_F", "RECV_B", "SEND_F", "SEND_B", "AR", "OPT")
PARTS = ("a2a", "a2a_table", "expert_AR")


def plans_of(layers: int) -> list[Plan]:
    out = []
    for starts, reps, widths in LAYOUTS:
        plan = straight_plan(layers, list(starts), global_batch_size=BATCH, num_micro_batches=1,
                             replicas=list(reps), schedule="dapple")  # fmt: skip
        stages = tuple(
            dataclasses.replace(st, expert_width=e)
            for st, e in zip(plan.stages, widths, strict=True)
        )
        out.append(dataclasses.replace(plan, stages=stages))
    return out


def label(plan: Plan) -> str:
    return "; ".join(
        f"[{st.layers[0]},{st.layers[1]}) {st.replicas}"
        + (f" e{st.expert_width}" if st.expert_width > 1 else "")
        for st in plan.stages
    )


# -- the workers --------------------------------------------------------------------------------
_ACC: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
"""Per action kind or exchange part: wall ms and this thread's CPU ms, summed."""


def _timed(name: str, fn: Any) -> Any:
    def run(*a: Any, **k: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc = _ACC[name]
            acc[0] += (time.perf_counter() - t0) * 1e3
            acc[1] += (time.thread_time() - c0) * 1e3

    return run


def _instrument(skip: int) -> None:
    """Time every action the interpreter runs and the expert exchange's collectives; drop what
    the first ``skip`` steps of each run summed."""
    from dapple.runtime.interpreter import ProgramInterpreter
    from dapple.runtime.parallel.expert import ExpertShards
    from dapple.runtime.parallel.expert.exchange import GroupCollectives

    def execute(self: Any, ops: Any) -> None:
        for op in ops:
            self._at = op
            _timed(op.action.kind.value, op.run)(op.action)

    step = ProgramInterpreter.run_step

    def run_step(self: Any, *a: Any, **k: Any) -> Any:
        n = getattr(self, "_bench_steps", 0)
        if n == skip:
            _ACC.clear()
        self._bench_steps = n + 1
        return step(self, *a, **k)

    ProgramInterpreter._execute = execute  # type: ignore[method-assign]
    ProgramInterpreter.run_step = run_step  # type: ignore[method-assign]
    GroupCollectives.all_to_all = _timed("a2a", GroupCollectives.all_to_all)  # type: ignore[method-assign]
    GroupCollectives.all_gather = _timed("a2a_table", GroupCollectives.all_gather)  # type: ignore[method-assign]
    ExpertShards.reduce_grads = _timed("expert_AR", ExpertShards.reduce_grads)  # type: ignore[method-assign]


def _probe(dist: Any, torch: Any, calls: int = 10) -> list[float]:
    """Wall ms per call of a one-element all-reduce and all-to-all over the 4 ranks, back to
    back after a barrier: what one collective's synchronisation costs at this load."""
    out = []
    for op in (lambda t: dist.all_reduce(t), lambda t: dist.all_to_all_single(t.clone(), t)):
        t = torch.zeros(dist.get_world_size())
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            op(t)
        out.append((time.perf_counter() - t0) * 1e3 / calls)
    return out


def matmul_cpu_ms(repeats: int = 80, n: int = 384) -> float:
    """CPU ms (this thread) of the calibration's ``n x n`` matmul at the runtime's threads: the
    unit the CPU-time profile is in."""
    import torch

    from dapple.calibrate.machine import runtime_threads

    old = torch.get_num_threads()
    torch.set_num_threads(runtime_threads(4))
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        c0 = time.thread_time()
        for _ in range(repeats):
            a @ b
        return (time.thread_time() - c0) * 1e3 / repeats
    finally:
        torch.set_num_threads(old)


def _worker(
    rank: int, world: int, port: int, model: str, plans: list[dict[str, Any]],
    opts: dict[str, Any], out: str,
) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    from dapple.calibrate.machine import busy_sweep
    from dapple.models.spec import load
    from dapple.runtime import TrainConfig, run_plan, shutdown_distributed

    join_worker_group(rank, world, port)
    _instrument(opts["skip"])
    wl = load(f"hf:{model}")
    n = len(plans)
    times: dict[int, list[float]] = {i: [] for i in range(n)}
    shared: dict[int, list[list[float]]] = {i: [] for i in range(n)}
    parts: dict[int, list[Any]] = {i: [] for i in range(n)}
    probes: dict[int, list[list[float]]] = {i: [] for i in range(n)}
    for rnd in range(opts["rounds"]):
        order = [(i + rnd * 2) % n for i in range(n)][:: -1 if rnd % 2 else 1]
        for i in order:
            shared[i].append(busy_sweep(rank, world))
            probes[i].append(_probe(dist, torch))
            _ACC.clear()
            cfg = TrainConfig(steps=opts["chunk"], seed=rnd, optimizer="adamw", lr=1e-3,
                              device="cpu")  # fmt: skip
            run = run_plan(Plan.from_dict(plans[i]), wl, cfg, device=torch.device("cpu"),
                           exact_world=False)  # fmt: skip
            kept = opts["chunk"] - opts["skip"]
            mine = {k: [v[0] / kept, v[1] / kept] for k, v in _ACC.items()}
            got: list[Any] = [None] * world
            dist.all_gather_object(got, mine)
            parts[i].append(got)
            if rank == 0:
                med = statistics.median(m.step_ms for m in run.metrics[opts["skip"] :])
                times[i].append(med)
                print(f"  round {rnd} {label(Plan.from_dict(plans[i])):28s} {med:8.1f} ms "
                      f"({load_note()})", flush=True)  # fmt: skip
    if rank == 0:
        Path(out).write_text(
            json.dumps({"times": times, "shared": shared, "parts": parts, "probes": probes})
        )
    shutdown_distributed()


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Profile, calibrate and measure on this machine: every input of :func:`report`."""
    import transformers as tf

    from dapple.api import profile
    from dapple.calibrate.machine import _matmul_alone_ms, calibrate, runtime_threads
    from dapple.host.cpu_cores import usable_cores

    nproc = 4
    threads = runtime_threads(nproc)
    model = Path(tempfile.mkdtemp(prefix="dapple-moe-fid-")) / "mixtral"
    tf.MixtralConfig(**CONFIG).save_pretrained(model)
    saved = Path(args.prep) if args.prep else None
    if saved is not None and saved.exists():  # a profile and calibration of an earlier run
        prep = json.loads(saved.read_text())
    else:
        t0 = time.perf_counter()
        prof = profile(f"hf:{model}", batch_sizes=(1, 2, 4, 8, 16), device="cpu",
                       num_threads=threads, co_workers=nproc)  # fmt: skip
        alone_ms = _matmul_alone_ms(nproc)
        cal = calibrate(nproc)
        prep = {"profile": prof.to_dict(), "cluster": cal.cluster.to_dict(),
                "matmul_alone_ms": alone_ms, "prep_s": time.perf_counter() - t0,
                "prep_load": load_note()}  # fmt: skip
        if saved is not None:
            saved.write_text(json.dumps(prep))
    prof = ModelProfile.from_dict(prep["profile"])
    prep["matmul_cpu_ms"] = matmul_cpu_ms()
    plans = plans_of(prof.num_layers)
    opts = {"rounds": args.rounds, "chunk": args.chunk, "skip": args.skip}
    got = run_worker_group(_worker, nproc, str(model), [p.to_dict() for p in plans], opts)
    n = len(plans)
    return {
        "args": {"rounds": args.rounds, "chunk": args.chunk, "skip": args.skip},
        "threads": threads,
        "usable_cores": usable_cores(),
        **prep,
        "plans": [p.to_dict() for p in plans],
        "times": [got["times"][str(i)] for i in range(n)],
        "shared": [got["shared"][str(i)] for i in range(n)],
        "parts": [got["parts"][str(i)] for i in range(n)],
        "probes": [got["probes"][str(i)] for i in range(n)],
    }


# -- the report ---------------------------------------------------------------------------------
def _fitted(
    inp: dict[str, Any], cluster: Cluster, sweep: list[float], probe: list[float] | None
) -> Cluster:
    """``cluster`` re-fitted to what was measured right before a chunk: the sharing (c, E)
    to its sweep; a lone worker's wall ms per CPU ms of the profile (the sweep's k = 1 matmul
    over the same matmul's CPU time: the profile holds CPU time, which a loaded machine
    stretches); the links' latency to one collective call's (the probe's all-to-all)."""
    from dapple.calibrate.machine import fit_sharing

    c, e = fit_sharing(sweep, inp["usable_cores"] / inp["threads"])
    ref = inp.get("matmul_cpu_ms") or inp["matmul_alone_ms"]
    # the in-run wall per CPU ms is the compute slowdown here, so the calibration's own
    # lone_wall_per_cpu (dapple.cost.cpu_clock) is not charged on top of it
    out = dataclasses.replace(cluster, compute_cores_per_server=c, background_load_per_server=e,
                              compute_slowdown=sweep[0] / ref, lone_wall_per_cpu=1.0)  # fmt: skip
    if probe is not None:
        out = dataclasses.replace(out, intra_server_latency_ms=probe[1],
                                  inter_server_latency_ms=probe[1])  # fmt: skip
    return out


def _sim_kinds(plan: Plan, profile: ModelProfile, cluster: Cluster) -> dict[int, dict[str, float]]:
    """Per device, the simulated ms of each action kind in one step."""
    out: dict[int, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(KINDS, 0.0))
    for ev in simulate(plan, profile, cluster).events:
        k = ev.action.kind.value
        if k in KINDS:
            out[ev.device][k] += ev.end_ms - ev.start_ms
    return out


def _cells(pred: list[float], meas: list[float]) -> list[str]:
    return [f"{p:.1f} ({(p - m) / m:+.0%})" for p, m in zip(pred, meas, strict=True)]


def _pairs(plans: list[Plan]) -> list[tuple[int, int]]:
    """(EP plan, its e_s = 1 twin) index pairs."""
    out = []
    for i, p in enumerate(plans):
        if any(st.expert_width > 1 for st in p.stages):
            base = [dataclasses.replace(st, expert_width=1) for st in p.stages]
            j = next(j for j, q in enumerate(plans) if list(q.stages) == base)
            out.append((i, j))
    return out


def report(inp: dict[str, Any]) -> list[str]:
    """The tables from :func:`collect`'s inputs, predicted by this checkout's model."""
    profile = ModelProfile.from_dict(inp["profile"])
    cluster = Cluster.from_dict(inp["cluster"])
    plans = [Plan.from_dict(p) for p in inp["plans"]]
    times, shared, parts = inp["times"], inp["shared"], inp["parts"]
    meas = [statistics.median(t) for t in times]
    L = [pipeline_latency(p, profile, cluster).L_ms for p in plans]
    sim = [simulate(p, profile, cluster).step_ms for p in plans]
    probes = inp.get("probes") or [[None] * len(x) for x in shared]
    fits = [[_fitted(inp, cluster, x, q) for x, q in zip(shared[i], probes[i], strict=True)]
            for i in range(len(plans))]  # fmt: skip
    L2 = [statistics.median(pipeline_latency(p, profile, c).L_ms for c in fits[i])
          for i, p in enumerate(plans)]  # fmt: skip
    sim2 = [statistics.median(simulate(p, profile, c).step_ms for c in fits[i])
            for i, p in enumerate(plans)]  # fmt: skip
    cols = [L, sim, L2, sim2]
    a = inp["args"]
    caps = [c.compute_cores_per_server or 0.0 for f in fits for c in f]
    lone = [c.compute_slowdown for f in fits for c in f]
    lines = [
        f"Model: `MixtralForCausalLM` from config {CONFIG} (local, random weights), global "
        f"batch {BATCH}, M = 1; 4 gloo processes with {inp['threads']} intra-op thread(s) each "
        f"({inp['usable_cores']} usable cores). Profile: `dapple.api.profile(batch_sizes=(1, 2, "
        "4, 8, 16), co_workers=4)` (each layer's CPU time as one of 4 workers; the MoE blocks' "
        "router, experts and expert load measured apart). Cluster: `calibrate(4)`: links "
        f"{cluster.intra_server_bandwidth_gbps:.2f} Gbps, latency "
        f"{cluster.intra_server_latency_ms:.3f} ms, c = "
        f"{cluster.compute_cores_per_server or 0:.2f}, E = "
        f"{cluster.background_load_per_server:.2f}, host CPU {cluster.action_overhead_ms:.3f} ms "
        f"per action, {cluster.step_overhead_ms:.2f} ms per step, "
        f"{cluster.comm_cpu_ms_per_mb:.3f} ms per MiB. Profiling + calibration: "
        f"{inp['prep_s']:.0f} s.",
        "",
        f"Measured: the plans interleaved in one 4-process group ({a['rounds']} rounds x "
        f"{a['chunk']} AdamW steps per plan, order rotated and alternating, first {a['skip']} "
        "dropped); measured = median over rounds of each chunk's median step. In-run: each "
        "chunk predicted with the sharing fitted to the sweep right before it (slowdown of a "
        f"lone worker min {min(lone):.2f} / median {statistics.median(lone):.2f} / max "
        f"{max(lone):.2f}; c min {min(caps):.2f} / median {statistics.median(caps):.2f} / max "
        f"{max(caps):.2f}), median over rounds.",
        "",
        "| plan | measured ms (range) | L ms (err) | simulated ms (err) | L in-run (err) "
        "| sim in-run (err) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(plans):
        cells = " | ".join(f"{c[i]:.1f} ({(c[i] - meas[i]) / meas[i]:+.0%})" for c in cols)
        lines.append(f"| {label(p)} | {meas[i]:.1f} ({min(times[i]):.1f}-{max(times[i]):.1f}) "
                     f"| {cells} |")  # fmt: skip
    names = ("L", "simulated", "L in-run", "sim in-run")
    lines += ["", "| EP plan / its e_s = 1 twin | measured | "
              + " | ".join(names) + " | ranked right |", "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    right = {n: 0 for n in names}
    pairs = _pairs(plans)
    for i, j in pairs:
        r_m = meas[i] / meas[j]
        rs = [c[i] / c[j] for c in cols]
        ok = ["yes" if (r > 1) == (r_m > 1) else "no" for r in rs]
        for n, o in zip(names, ok, strict=True):
            right[n] += o == "yes"
        lines.append(f"| {label(plans[i])} / e1 | {r_m:.3f} | "
                     + " | ".join(f"{r:.3f}" for r in rs) + " | " + ", ".join(
                         f"{n}: {o}" for n, o in zip(names, ok, strict=True)) + " |")  # fmt: skip
    lines += [""]
    for n, c in zip(names, cols, strict=True):
        errs = [abs(x - m) / m for x, m in zip(c, meas, strict=True)]
        lines.append(f"- {n}: {sum(e <= 0.25 for e in errs)}/{len(errs)} plans within 25% "
                     f"(max {max(errs):.0%}), EP ranked right on {right[n]}/{len(pairs)} "
                     f"pairs, Spearman {spearman(c, meas):.2f}")  # fmt: skip
    return [*lines, "", *_components(profile, cluster, plans, fits, parts)]


def _components(
    profile: ModelProfile, cluster: Cluster, plans: list[Plan], fits: list[list[Cluster]],
    parts: list[list[list[dict[str, list[float]]]]],
) -> list[str]:  # fmt: skip
    """Per plan and rank: each action kind's measured wall ms per step (median over rounds;
    the main thread's CPU ms beside it) against the in-run simulator's, and the expert
    exchange's parts inside F, B and AR."""
    lines = [
        "Per rank and step, measured wall ms (its main thread's CPU ms) against the in-run "
        "simulator (median over rounds); `a2a` is the expert exchange's all-to-alls inside F "
        "and B (predicted: A2A_s each way, bytes and latency, before sharing), `table` the "
        "route table's all-gather (not modelled), `eAR` the experts' AllReduce inside AR.",
        "",
        "| plan | rank | " + " | ".join(KINDS) + " | a2a (pred) | table | eAR |",
        "|---|---:|" + "---:|" * (len(KINDS) + 3),
    ]
    for i, p in enumerate(plans):
        sims = [_sim_kinds(p, profile, c) for c in fits[i]]
        for st in p.stages:
            a2a = 0.0
            if st.expert_width > 1:
                a2a = expert_alltoall_ms(profile, cluster, st.layers,
                                         expert_group_shapes(cluster, st), max(st.slice_sizes(
                                             p.micro_batch_size)))  # fmt: skip
            for d in st.devices:
                rows = [r[d] for r in parts[i]]

                def med(k: str, rows: list[dict[str, list[float]]] = rows) -> tuple[float, float]:
                    w = statistics.median(r.get(k, [0.0, 0.0])[0] for r in rows)
                    return w, statistics.median(r.get(k, [0.0, 0.0])[1] for r in rows)

                cells = []
                for k in KINDS:
                    w, c = med(k)
                    pk = statistics.median(x[d][k] for x in sims)
                    cells.append(f"{w:.1f} ({c:.1f}) / {pk:.1f}")
                x = [med(k) for k in PARTS]
                lines.append(
                    f"| {label(p)} | {d} | " + " | ".join(cells)
                    + f" | {x[0][0]:.1f} ({x[0][1]:.1f}) / {2 * a2a:.1f} | {x[1][0]:.1f} "
                    f"({x[1][1]:.1f}) | {x[2][0]:.1f} ({x[2][1]:.1f}) |"
                )  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--chunk", type=int, default=4, help="steps per plan per round")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps dropped per chunk")
    ap.add_argument("--out", required=True, help="markdown report (inputs saved beside it)")
    ap.add_argument("--replay", metavar="INPUTS_JSON", help="re-predict a saved run")
    ap.add_argument("--prep", metavar="JSON", help="profile and calibration: read from this "
                    "file when it exists, else measured and written to it")  # fmt: skip
    args = ap.parse_args(argv)
    command = "python benchmarks/moe_fidelity.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    out = Path(args.out)
    if args.replay:
        inp = json.loads(Path(args.replay).read_text())
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        lines = [*inp["header"][:-1], f"- replayed: `{command}` on {stamp} (nothing measured; "
                 "the predictions are this checkout's)", "", *report(inp),
                 f"End of the measured run: {inp['end_load']}.", ""]  # fmt: skip
    else:
        title = "MoE fidelity: predicted vs measured step, with and without expert parallelism"
        inp = {"header": header(title, command), **collect(args), "end_load": load_note()}
        out.with_suffix(".inputs.json").write_text(json.dumps(inp))
        lines = [*inp["header"], *report(inp), f"End: {inp['end_load']}.", ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
