"""Mixed devices emulated on CPU (issue #43, item 4): the plan made with device kinds against the
plan made for the slowest kind, predicted against measured, in one run.

Three local workers emulate a two-speed cluster: ranks 0 and 1 ``K`` times slower than this
machine's core, rank 2 ``3K`` times (``DAPPLE_SLOWDOWN=0:K,1:K,2:3K``,
:mod:`dapple.runtime.slowdown`: each forward and backward sleeps ``K - 1`` times its thread CPU
time, so the emulated compute does not compete for the 2 cores). The cost model sees the same
cluster as device kinds: three one-device servers, speeds ``1/K, 1/K, 1/(3K)``.

The profile is the zoo MLP's measured in *thread CPU time* (the quantity the slow-down scales),
one intra-op thread, at 1, 4, 16 and G samples, on this machine, in this run; the links are
gloo's measured loopback bandwidth (:data:`GLOO_GBPS`). Three plans:

- **device kinds**: ``make_plan(profile, cluster, G)``: the planner with the speeds;
- **slowest kind**: ``make_plan(profile, cluster.slowest_kind(), G)``: every device as slow as
  rank 2, what planning without kinds gives;
- **slowest kind's stages, balanced shares**: that plan's stages and devices with the shares the
  planner gives them on the cluster with kinds (:func:`~dapple.planner.shares.with_kind_shares`):
  the unequal shares alone.

Each plan's predicted step is the cost model's on the cluster with kinds
(:func:`~dapple.cost.schedule_step.schedule_latency`); its measured step the median ``step_ms`` of
its steps after the first two (SGD). Rounds alternate the plans; each measured ratio is the
median of the per-round ratios of a plan's step over the device-kinds plan's.

Usage: ``python benchmarks/heterogeneous_cpu.py [--k 20 --rounds 3 --steps 6 --out
benchmarks/heterogeneous_cpu.md]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import header, load_note
from dapple import api
from dapple.core.cluster import GIB, Cluster
from dapple.core.device_kinds import DeviceKind
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.schedule_step import schedule_latency
from dapple.planner import make_plan
from dapple.planner.shares import with_kind_shares
from dapple.profiler.measure import _profile
from dapple.runtime.slowdown import SLOWDOWN_ENV

GLOO_GBPS = 7.4
"""Loopback bandwidth of a gloo ring AllReduce on this machine: 4 processes reduced 400 MB in
648 ms at load 3 (``benchmarks/gloo_collectives.md``), 2 x 3/4 x 400 MB per process."""


def emulated(k: float) -> Cluster:
    """Three one-device servers: two at speed 1/K, one at 1/(3K); gloo over loopback."""
    kinds = (
        DeviceKind(name="fast", servers=2, speed=1 / k, device_memory_bytes=4 * GIB),
        DeviceKind(name="slow", servers=1, speed=1 / (3 * k), device_memory_bytes=4 * GIB),
    )
    return Cluster(
        name=f"emulated 2 x K={k:g} + 1 x K={3 * k:g}",
        servers=3,
        devices_per_server=1,
        device_memory_bytes=4 * GIB,
        intra_server_bandwidth_gbps=GLOO_GBPS,
        inter_server_bandwidth_gbps=GLOO_GBPS,
        intra_server_latency_ms=0.05,
        inter_server_latency_ms=0.05,
        device_name="cpu-process",
        kinds=kinds,
    )


def cpu_time_profile(args: argparse.Namespace) -> ModelProfile:
    """The MLP's layers in thread CPU time, one thread (module docstring)."""
    torch.set_num_threads(1)
    wl = api.load("mlp", layers=args.layers, in_features=args.hidden, hidden=args.hidden)
    sizes = sorted({1, 4, 16, args.global_batch})  # a share may be any of 1 .. G samples
    return _profile(wl, sizes, torch.device("cpu"), 2, 7, None, 0, cpu_time=True)


def step_ms(plan: Plan, args: argparse.Namespace) -> float:
    wl = api.load("mlp", layers=args.layers, in_features=args.hidden, hidden=args.hidden)
    metrics = api.train(plan, wl, args.steps, device="cpu", optimizer="sgd", lr=1e-3, seed=1,
                        echo=False)  # fmt: skip
    return statistics.median(m.step_ms for m in metrics[2:])


def describe(plan: Plan) -> str:
    b = plan.micro_batch_size
    return (
        "; ".join(
            f"[{s.layers[0]},{s.layers[1]}) on {','.join(map(str, s.devices))} "
            f"slices {':'.join(map(str, s.slice_sizes(b)))}"
            for s in plan.stages
        )
        + f"; M={plan.num_micro_batches}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=float, default=20.0, help="slow-down K of ranks 0, 1 (2: 3K)")
    ap.add_argument("--layers", type=int, default=4, help="MLP hidden blocks (head besides)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    k = args.k
    spec = f"0:{k:g},1:{k:g},2:{3 * k:g}"
    os.environ[SLOWDOWN_ENV] = spec
    start_load = load_note()
    t0 = time.time()
    profile = cpu_time_profile(args)
    cluster = emulated(k)
    G = args.global_batch
    slow = make_plan(profile, cluster.slowest_kind(), G)
    plans = {
        "device kinds": make_plan(profile, cluster, G),
        "slowest kind": slow,
        "slowest kind's stages, balanced shares": with_kind_shares(slow, profile, cluster),
    }
    predicted = {n: schedule_latency(p, profile, cluster) for n, p in plans.items()}
    runs: dict[str, list[float]] = {n: [] for n in plans}
    for r in range(args.rounds):
        for name, plan in plans.items():
            runs[name].append(step_ms(plan, args))
            print(f"round {r}: {name} {runs[name][-1]:.1f} ms", flush=True)
    cmd = "python benchmarks/heterogeneous_cpu.py " + " ".join(sys.argv[1:])
    lines = header("Mixed devices emulated on CPU: device kinds vs slowest kind (#43)", cmd)
    lines += [
        f"- load at the end: {load_note()} (start: {start_load}); {time.time() - t0:.0f} s",
        "",
        f"Zoo MLP of {args.layers} blocks of {args.hidden} and a head; G = {G}; "
        f"`{SLOWDOWN_ENV}={spec}`; cluster `{cluster.name}` (speeds 1/{k:g}, 1/{k:g}, "
        f"1/{3 * k:g}); profile in thread CPU time on this machine in this run.",
        "",
        "| plan | stages | predicted ms | "
        + " | ".join(f"round {r} ms" for r in range(args.rounds))
        + " | median ms | measured / predicted |",
        "|---|---|---|" + "---|" * (args.rounds + 2),
    ]
    for name, plan in plans.items():
        med = statistics.median(runs[name])
        cells = " | ".join(f"{x:.0f}" for x in runs[name])
        lines.append(
            f"| {name} | {describe(plan)} | {predicted[name]:.0f} | {cells} | {med:.0f} | "
            f"{med / predicted[name]:.2f} |"
        )
    lines.append("")
    for name in list(plans)[1:]:
        pred = predicted[name] / predicted["device kinds"]
        pairs = [s / a for s, a in zip(runs[name], runs["device kinds"], strict=True)]
        meas = statistics.median(pairs)
        lines.append(
            f"- {name} / device kinds: predicted {pred:.2f}, measured {meas:.2f} (per round: "
            + ", ".join(f"{p:.2f}" for p in pairs)
            + f"); measured / predicted {meas / pred:.2f}"
        )
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
