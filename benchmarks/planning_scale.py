"""CPU seconds of one DAPPLE search on a large analytic profile (issue 48).

Plans a profile from ``dapple profile --analytic`` on ``--servers`` servers of 8 H100 with the
options of ``dapple plan --zero-stage auto --tensor-widths auto --interleave`` (without
``--interleave`` given ``--no-interleave``; the grid planner's search given ``--planner grid``)
and prints one JSON line: CPU seconds of the search in this process (``time.process_time``,
user + sys), wall seconds, L, M, the schedule and the stages ``[start, end, devices, tensor
width, zero stage]`` (with ``--simulate`` also the plan's simulated step). Run it under two
checkouts (``PYTHONPATH=.../src``) to compare search speed and check the plans are the same; :mod:`planning_sweep` runs it over models and sizes.

    dapple profile --analytic h100 -m llama3.1-405b --precision fp8 --recompute full -o p405.json
    python benchmarks/planning_scale.py p405.json --servers 64 --global-batch-size 256
"""

from __future__ import annotations

import argparse
import json
import time

from dapple.core.cluster_presets import load_cluster
from dapple.planner.grid import grid_plan
from dapple.planner.search import dapple_search
from dapple.profiler.paper_models import load_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("profile", help="profile JSON (dapple profile --analytic ...)")
    ap.add_argument("--servers", type=int, default=64, help="servers of 8 H100 (h100-8x)")
    ap.add_argument("--global-batch-size", type=int, default=256)
    ap.add_argument("--no-interleave", action="store_true", help="1F1B plans only")
    ap.add_argument("--planner", choices=("dapple", "grid"), default="dapple")
    ap.add_argument("--simulate", action="store_true", help="also the plan's simulated step")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    cluster = load_cluster("h100-8x", args.servers)
    t0, w0 = time.process_time(), time.perf_counter()
    if args.planner == "grid":
        plan = grid_plan(profile, cluster, args.global_batch_size)
    else:
        plan = dapple_search(profile, cluster, args.global_batch_size, zero_stage="auto",
                             tensor_widths=None, interleaved=not args.no_interleave)  # fmt: skip
    out = {
        "cpu_s": round(time.process_time() - t0, 2),
        "wall_s": round(time.perf_counter() - w0, 2),
        "L": plan.predicted_step_ms,
        "M": plan.num_micro_batches,
        "schedule": plan.schedule,
        "stages": [
            [*st.layers, len(st.devices), st.tensor_width, st.zero_stage] for st in plan.stages
        ],
    }
    if args.simulate:
        from dapple.simulate import simulate

        out["simulated_ms"] = simulate(plan, profile, cluster).step_ms
    print(json.dumps(out))


if __name__ == "__main__":
    main()
