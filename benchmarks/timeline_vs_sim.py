"""Measured timelines against the simulator, action by action: where a predicted step and a
measured one part.

Run a fidelity measurement with the runtime's timeline on (``dapple.runtime.timeline``), then
compare each plan's measured actions with the simulated ones on the run's own profile and
calibrated cluster::

    DAPPLE_TIMELINE=/tmp/tl python benchmarks/fidelity.py --out /tmp/fid.md
    python benchmarks/timeline_vs_sim.py /tmp/fid.inputs.json /tmp/tl [--out FILE.md]

Per plan and per computation stage and action kind (F, B, SEND_*, RECV_*, AR, OPT), over the
steps after each run's first and over the stage's replicas: the median measured wall time,
the CPU time of the rank's thread in it, the simulated duration on the calibrated cluster
(processor sharing and host CPU terms, as the L and simulated columns of ``fidelity.md``) and
the nominal one (the same cluster with dedicated cores: the profile's time plus the host
terms, unstretched). Per plan: the measured step (median over ranks and steps), the CPU its
ranks spent in actions per step, and the simulated step. Pure reading of saved files and the
simulator; no timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.simulate import simulate
from dapple.simulate.result import SimResult
from fidelity import label

KINDS = ("F", "B", "RECV_F", "SEND_F", "RECV_B", "SEND_B", "AR", "OPT")


def _key(plan: dict[str, Any]) -> str:
    return json.dumps(
        [plan["stages"], plan["num_micro_batches"], plan["schedule"], plan.get("policy")],
        sort_keys=True,
    )


def measured(folder: Path) -> dict[str, dict[str, Any]]:
    """Per plan (its stages, M, schedule and policy): per (stage, kind) the wall and CPU ms of
    every action after each run's first step, and per rank and step the step's wall ms and the
    CPU ms in its actions."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(folder.glob("timeline-*.json")):
        d = json.loads(f.read_text())
        k = _key(d["plan"])
        got = out.setdefault(
            k, {"acts": defaultdict(list), "steps": [], "ranks": defaultdict(list)}
        )
        for recs in d["records"][1:]:
            cpu = 0.0
            row: dict[str, float] = {}
            for _pos, kind, stage, _mb, _rep, _peer, t0, t1, c in recs:
                if kind in ("STEP", "PROCESS"):
                    row["wall"], row[kind] = t1, c
                    continue
                got["acts"][stage, kind].append((t1 - t0, c))
                cpu += c
            got["steps"].append(row["wall"])
            got["ranks"][d["rank"]].append((row["wall"], cpu, row["STEP"], row["PROCESS"]))
    return out


def simulated(plan: Plan, profile: ModelProfile, cluster: Cluster) -> tuple[SimResult, dict]:
    """The simulated step and per (stage, kind) its actions' durations."""
    r = simulate(plan, profile, cluster)
    acts: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in r.events:
        acts[e.action.stage, e.action.kind.value].append(e.duration_ms)
    return r, acts


def report(inputs: Path, folder: Path) -> list[str]:
    inp = json.loads(inputs.read_text())
    profile = ModelProfile.from_dict(inp["profile"])
    cluster = Cluster.from_dict(inp["cluster"])
    dedicated = dataclasses.replace(cluster, compute_cores_per_server=None)
    meas = measured(folder)
    lines = [
        f"Inputs `{inputs.name}`, timelines `{folder}`: cluster c = "
        f"{cluster.compute_cores_per_server}, E = {cluster.background_load_per_server}; host "
        f"{cluster.action_overhead_ms:.3f} ms per action, {cluster.step_overhead_ms:.2f} ms per "
        f"step, {cluster.comm_cpu_ms_per_mb:.3f} ms per MiB.",
        "",
    ]
    for pd in inp["plans"]:
        plan = Plan.from_dict(pd)
        m = meas.get(_key(pd))
        if m is None or not m["steps"]:
            continue
        run, sim = simulated(plan, profile, cluster)
        alone, nominal = simulated(plan, profile, dedicated)
        step = run.step_ms
        med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
        busy = {d.device: d.busy_ms for d in alone.devices}
        lines += [
            f"**{label(plan)}**: measured step {med(m['steps']):.1f} ms (median over ranks "
            f"and steps), simulated {step:.1f} ms. Per rank, medians over steps: wall ms / CPU "
            "ms in actions / the thread's CPU ms in the step / the process's CPU ms in the step "
            "/ the simulated device's nominal busy ms: "
            + "; ".join(
                f"rank {r}: {med([x[0] for x in v]):.1f} / {med([x[1] for x in v]):.1f} / "
                f"{med([x[2] for x in v]):.1f} / {med([x[3] for x in v]):.1f} / "
                f"{busy.get(r, 0.0):.1f}"
                for r, v in sorted(m["ranks"].items())
            )
            + ".",
            "",
            "| stage | action | n | measured wall ms | measured CPU ms | simulated ms | nominal ms |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for s in range(plan.num_stages):
            for kind in KINDS:
                got = m["acts"].get((s, kind))
                if not got:
                    continue
                sims, noms = sim.get((s, kind), []), nominal.get((s, kind), [])
                cell = lambda xs: f"{statistics.median(xs):.2f}" if xs else "-"  # noqa: E731
                lines.append(
                    f"| {s} | {kind} | {len(got)} | {cell([w for w, _ in got])} | "
                    f"{cell([c for _, c in got])} | {cell(sims)} | {cell(noms)} |"
                )
        lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("inputs", type=Path, help="a fidelity run's *.inputs.json")
    ap.add_argument("timelines", type=Path, help="the DAPPLE_TIMELINE folder of that run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = "\n".join(report(args.inputs, args.timelines)) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
