"""dapple's runtime vs ``torch.distributed.pipelining`` and DDP on the same partition (CPU, gloo).

Same model (:data:`_bench_common.BENCH_MODEL`), same layer partition, same global batch and
number of micro-batches M, same optimizer (plain SGD) and steps, same intra-op threads per
process (``cores // processes``, as dapple's runtime sets). Peers:

- ``torch 1F1B`` / ``torch GPipe``: ``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleGPipe``
  for straight 2- and 4-stage pipelines, compared with dapple's straight plans under the
  ``dapple`` (1F1B, policy A) and ``gpipe`` schedules;
- ``torch DDP``: ``DistributedDataParallel`` on 2 and on 4 processes, against dapple's pure-DP
  plan;
- ``dapple planned``: dapple's own plan for up to 4 local processes - for k = 2 and 4 processes
  a co-worker profile, ``calibrate(k)`` and ``make_plan``, the lowest predicted L wins (the
  number of processes sharing the cores is part of the plan) - run on the processes it uses,
  against the best hand-configured peer on 2 or 4 processes.

Every configuration is timed per step as the period between consecutive step ends, steps
running back to back after one barrier per chunk (dapple: its ``StepMetrics.step_ms``, the
period between its per-step collectives, which every rank meets; peers: each rank's period,
then ``all_reduce(MAX)``); every runner builds its batch inside the step; samples/s is the
global batch over the median step time after warm-up. The configurations run in
alternating rounds (dapple and peer back to back) so machine load hits both.

Usage: ``python benchmarks/vs_torch_pipelining.py [--rounds 6 --chunk 5 --skip 2] [--no-planned]``.
"""

from __future__ import annotations

import argparse
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
    WARM_UP,
    back_to_back_ms,
    bench_transformer,
    header,
    join_worker_group,
    load_note,
    max_over_ranks,
    run_worker_group,
)
from dapple.core.plan import Plan, straight_plan

LR = 0.01


# -- one process group per world size, cases interleaved chunk by chunk -----------------------
class _Peer:
    """A torch peer set up once per process group: DDP or a PipelineStage + schedule."""

    def __init__(self, kind: str, rank: int, world: int, G: int, M: int, bounds: list[int]):
        self.kind, self.rank, self.world, self.G = kind, rank, world, G
        wl = bench_transformer()
        self.wl = wl
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model: Any = DDP(wl.build_model(0))
            self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        else:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            module = wl.build_stage(bounds[rank], bounds[rank + 1], 0)
            stage = PipelineStage(module, rank, world, torch.device("cpu"))
            cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
            self.sched = cls(stage, n_microbatches=M, loss_fn=wl.loss_fn)
            self.opt = torch.optim.SGD(module.parameters(), lr=LR)

    def step(self, step: int) -> None:
        """One optimizer step on the batch of ``step`` (built here, as dapple's runtime does)."""
        x, y = self.wl.make_batch(self.G, step)
        r, w = self.rank, self.world
        if self.kind == "ddp":
            per = self.G // w
            loss = self.wl.loss_fn(
                self.model(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per]
            )
            loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
        elif r == 0:
            self.sched.step(x)
        elif r == w - 1:
            self.sched.step(target=y, losses=[])
        else:
            self.sched.step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def chunk(self, steps: list[int]) -> list[float]:
        """This rank's ms per step over back-to-back steps after one barrier
        (:func:`_bench_common.back_to_back_ms`)."""
        return back_to_back_ms(self.step, steps)


def _group_worker(
    rank: int, world: int, port: int, cases: list[dict[str, Any]], opts: dict[str, Any], out: str
) -> None:
    from dapple.runtime import TrainConfig, run_plan, shutdown_distributed

    join_worker_group(rank, world, port)  # as dapple's CPU ranks, for both runners
    wl = bench_transformer()
    peers: dict[int, _Peer] = {}
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    chunk, skip = opts["chunk"], opts["skip"]
    for rnd in range(opts["rounds"]):
        order = list(range(len(cases)))
        if rnd % 2:
            order.reverse()
        for i in order:
            c = cases[i]
            if c["runner"] == "dapple":
                cfg = TrainConfig(steps=chunk, seed=rnd, optimizer="sgd", lr=LR, device="cpu")
                run = run_plan(Plan.from_dict(c["plan"]), wl, cfg, device=torch.device("cpu"))
                ms = [m.step_ms for m in run.metrics]  # rank 0: slowest rank per step
            else:
                if i not in peers:
                    peers[i] = _Peer(c["kind"], rank, world, c["G"], c["M"], c["bounds"])
                ms = max_over_ranks(peers[i].chunk([rnd * chunk + k for k in range(chunk)]))
            if rank == 0:  # dapple's metrics live on rank 0 only
                times[i].append(statistics.median(ms[skip:]))  # this round's median
                print(
                    f"  x{world} round {rnd} {c['label']:40s} {times[i][-1]:8.1f} ms"
                    f"  ({load_note()})",
                    flush=True,
                )
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    # DDP's reducer and the pipeline stages hold the process group: drop them first, so no
    # group outlives destroy_process_group into interpreter shutdown
    peers.clear()
    shutdown_distributed()


def run_group(world: int, cases: list[dict[str, Any]], opts: dict[str, Any]) -> list[list[float]]:
    """Run ``cases`` interleaved in one group of ``world`` processes; per case, each round's
    median step time (ms)."""
    got = run_worker_group(_group_worker, world, cases, opts)
    return [got[str(i)] for i in range(len(cases))]


# -- configurations ---------------------------------------------------------------------------
def even_bounds(num_layers: int, stages: int) -> list[int]:
    """Cut a ``num_layers`` chain into ``stages`` nearly equal contiguous ranges."""
    return [round(i * num_layers / stages) for i in range(stages + 1)]


def planned_plan(G: int, nproc: int) -> tuple[Plan, str]:
    """dapple's own plan for up to ``nproc`` local processes (:func:`dapple.calibrate.local.plan_local`):
    for k = 2, 4, .. ``nproc`` a profile as one of k co-located workers, ``calibrate(k)`` and
    ``make_plan`` for k devices; the lowest predicted L wins."""
    from dapple.calibrate.local import plan_local

    counts = [k for k in (2, 4, 8, 16) if k <= nproc]
    best, cands = plan_local(bench_transformer(), G, counts)
    notes = []
    for c in cands:
        cl = c.cluster
        notes.append(
            f"k = {c.processes}: {describe(c.plan)}, predicted {c.predicted_ms:.1f} ms "
            f"(profile batch sizes {list(c.profile.batch_sizes)} as one of {c.processes} "
            f"co-workers; calibrate({c.processes}): {cl.intra_server_bandwidth_gbps:.2f} Gbps, "
            f"latency {cl.intra_server_latency_ms:.3f} ms, c = "
            f"{cl.compute_cores_per_server or 0:.2f} compute units, host CPU "
            f"{cl.action_overhead_ms:.3f} ms/action + {cl.step_overhead_ms:.2f} ms/step)"
        )
    return best.plan, "; ".join(notes) + f"; chosen: the plan for {best.processes} processes"


def describe(plan: Plan) -> str:
    reps = ":".join(str(s.replicas) for s in plan.stages)
    cuts = ",".join(f"{s.layers[0]}-{s.layers[1]}" for s in plan.stages)
    return f"{reps} [{cuts}] M={plan.num_micro_batches} {plan.schedule}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    ap.add_argument("--chunk", type=int, default=5, help="steps per case per round")
    ap.add_argument("--skip", type=int, default=WARM_UP, help="warm-up steps dropped per chunk")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--no-planned", action="store_true", help="skip the planned plan")
    ap.add_argument("--out", default=str(HERE / "vs_torch_pipelining.md"))
    args = ap.parse_args(argv)
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python benchmarks/vs_torch_pipelining.py {args_text}".strip()
    lines = header("dapple runtime vs torch.distributed.pipelining / DDP (CPU, gloo)", command)
    G, M = args.global_batch, args.micro_batches
    n_layers = bench_transformer().num_layers
    cases: dict[int, list[dict[str, Any]]] = {2: [], 4: []}
    for S in (2, 4):
        b = even_bounds(n_layers, S)
        for sched, peer in (("dapple", "1f1b"), ("gpipe", "gpipe")):
            plan = straight_plan(
                n_layers, b[:-1], global_batch_size=G, num_micro_batches=M, schedule=sched
            )
            grp = f"straight {S} stages, cuts {b[1:-1]}, {'1F1B' if peer == '1f1b' else 'GPipe'}"
            cases[S].append(
                {
                    "group": grp,
                    "label": f"dapple ({sched} schedule)",
                    "runner": "dapple",
                    "plan": plan.to_dict(),
                }
            )
            cases[S].append(
                {
                    "group": grp,
                    "label": f"torch Schedule{'1F1B' if peer == '1f1b' else 'GPipe'}",
                    "runner": "peer",
                    "kind": peer,
                    "G": G,
                    "M": M,
                    "bounds": b,
                }
            )
    for world in (2, 4):  # data parallelism: dapple's pure-DP plan vs DDP
        dp = straight_plan(
            n_layers, [0], global_batch_size=G, num_micro_batches=1, replicas=[world]
        )
        cases[world].append(
            {
                "group": f"DP x{world}",
                "label": "dapple (pure-DP plan)",
                "runner": "dapple",
                "plan": dp.to_dict(),
            }
        )
        cases[world].append(
            {
                "group": f"DP x{world}",
                "label": "torch DDP",
                "runner": "peer",
                "kind": "ddp",
                "G": G,
                "M": 1,
                "bounds": [],
            }
        )
    plan_note = ""
    planned: Plan | None = None
    if not args.no_planned:
        t0 = time.perf_counter()
        planned, plan_note = planned_plan(G, 4)
        plan_note += f"; planning took {time.perf_counter() - t0:.0f} s"
        # the planner may leave processes idle (cores are shared): run the plan on as many
        # processes as it uses, in the group of that size
        cases.setdefault(len(planned.devices), []).append(
            {
                "group": "planned",
                "label": f"dapple planned: {describe(planned)}",
                "runner": "dapple",
                "plan": planned.to_dict(),
            }
        )
        print(
            f"planned: {describe(planned)}, predicted {planned.predicted_step_ms:.1f} ms",
            flush=True,
        )
    opts = {"rounds": args.rounds, "chunk": args.chunk, "skip": args.skip}
    ms: dict[tuple[str, str], float] = {}
    per_round: dict[tuple[str, str], list[float]] = {}
    for world, cs in cases.items():
        for c, t in zip(cs, run_group(world, cs, opts), strict=True):
            ms[(c["group"], c["label"])] = statistics.median(t)
            per_round[(c["group"], c["label"])] = t
    sps = {k: G / (v / 1e3) for k, v in ms.items()}
    lines += [
        f"Model: zoo `transformer` {BENCH_MODEL} ({n_layers} chain layers), global batch {G}, "
        f"M = {M} for the pipelines (micro-batch {G // M}), plain SGD lr {LR}. All cases of one "
        f"process count run in ONE gloo process group, interleaved: {args.rounds} rounds x "
        f"{args.chunk} steps per case (round order alternates, so dapple and its peer always "
        f"run back to back), the first {args.skip} step(s) of each chunk dropped; ms/step = "
        "median over rounds of each round's median. Step time = the period between consecutive "
        "step ends, steps back to back after one barrier per chunk (dapple: between its "
        "per-step collectives; peers: slowest rank). Threads per process: cores // processes. dapple / peer = median over rounds of "
        "the paired throughput ratio (peer ms / dapple ms in the same round), with its range.",
        "",
        "| configuration | runner | ms / step | samples/s | dapple / peer [range over rounds] |",
        "|---|---|---:|---:|---:|",
    ]
    ratios: list[tuple[str, float]] = []
    for cs in cases.values():
        groups = list(dict.fromkeys(c["group"] for c in cs))
        for grp in groups:
            rows = [c["label"] for c in cs if c["group"] == grp]
            d = [lab for lab in rows if lab.startswith("dapple")]
            for lab in rows:
                v = sps[(grp, lab)]
                ratio = ""
                if not lab.startswith("dapple") and d:
                    paired = [
                        pm / dm
                        for pm, dm in zip(
                            per_round[(grp, lab)], per_round[(grp, d[0])], strict=True
                        )
                    ]
                    r = statistics.median(paired)
                    ratio = f"**{r:.2f}x** [{min(paired):.2f}-{max(paired):.2f}]"
                    ratios.append((grp, r))
                lines.append(f"| {grp} | {lab} | {ms[(grp, lab)]:.1f} | {v:.1f} | {ratio} |")
    worst = min(ratios, key=lambda t: t[1])
    lines += [
        "",
        f"Goal dapple >= 1.0x the peer on the same partition: "
        f"**{'met' if worst[1] >= 1.0 else 'missed'}** (lowest ratio {worst[1]:.2f}x, {worst[0]}).",
    ]
    if planned is not None:
        n_used = len(planned.devices)
        peers = [(g, lab, v) for (g, lab), v in sps.items() if not lab.startswith("dapple")]
        hand = [
            (g, lab, v)
            for (g, lab), v in sps.items()
            if lab.startswith("dapple") and g != "planned"
        ]
        best_peer = max(peers, key=lambda t: t[2])
        best_hand = max(hand, key=lambda t: t[2])
        pv = sps[("planned", f"dapple planned: {describe(planned)}")]
        lines += [
            "",
            f"Planned plan for up to 4 processes ({plan_note}): {describe(planned)} on "
            f"{n_used} process(es), predicted {planned.predicted_step_ms:.1f} ms/step. Peers run "
            "on 2 and on 4 processes; cases of different process counts ran in different "
            "process groups one after the other (not interleaved), so those ratios carry the "
            "load drift between the groups.",
            f"- vs the best hand-configured peer ({best_peer[1]}, {best_peer[0]}, "
            f"{best_peer[2]:.1f} samples/s): **{pv / best_peer[2]:.2f}x** "
            f"({'beats it' if pv > best_peer[2] else 'does NOT beat it'})",
            f"- vs the best hand-configured dapple plan ({best_hand[1]}, {best_hand[0]}, "
            f"{best_hand[2]:.1f} samples/s): {pv / best_hand[2]:.2f}x",
        ]
    lines += ["", f"End: {load_note()}.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
