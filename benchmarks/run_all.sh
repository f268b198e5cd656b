#!/usr/bin/env bash
# Re-run every benchmark and rewrite its markdown result (about 30 minutes on 2 busy cores).
# Usage: benchmarks/run_all.sh [--quick]   (--quick: fewer rounds/steps, for a smoke run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
quick=${1:-}
run() { echo "== $*"; local t0=$SECONDS; "$PY" "$@"; echo "== done in $((SECONDS - t0)) s"; }

if [[ "$quick" == "--quick" ]]; then
  run benchmarks/paper.py --no-runtime --out /tmp/dapple-paper.md
  run benchmarks/fidelity.py --rounds 1 --chunk 2 --out /tmp/dapple-fidelity.md
  run benchmarks/vs_torch_pipelining.py --rounds 1 --chunk 2 --no-planned --out /tmp/dapple-vs.md
  run benchmarks/schedules_measured.py --rounds 1 --steps 2 --repeats 2 --out /tmp/dapple-schedules-measured.md
  run benchmarks/schedules_measured_v.py --rounds 1 --steps 2 --out /tmp/dapple-schedules-measured.md
  run benchmarks/train_real.py --rounds 1 --steps 8 --skip 2 --global-batch 16 --out /tmp/dapple-train-real.md
  run benchmarks/tp_memory.py --tiny --out /tmp/dapple-tp-memory.md
  exit 0
fi
# the planner engineer's benchmarks, when present
if [[ -f benchmarks/planning_time.py ]]; then
  run benchmarks/planning_time.py --repeat 3 --output benchmarks/planning_time.md --plot benchmarks/planning_time.png
fi
if [[ -f benchmarks/paper_planning.py ]]; then
  run benchmarks/paper_planning.py --output benchmarks/paper_planning.md
fi
run benchmarks/schedules.py --output benchmarks/schedules.md
# dapple vs the torchtitan-style grid, Llama-3 8B/70B on 64-512 H100 (analytic; ~15 min on 2 busy cores)
run benchmarks/plan_space.py --out benchmarks/plan_space.md
run benchmarks/sharded_state.py
# per-rank memory of TP2 / FSDP x2 / TP2 x FSDP2 vs one unsharded stage, tracked tensor bytes (~2 min)
run benchmarks/tp_memory.py --out benchmarks/tp_memory.md
run benchmarks/paper.py
run benchmarks/fidelity.py
run benchmarks/vs_torch_pipelining.py
run benchmarks/schedules_measured.py
# ZB-V / DualPipeV vs torch's on 2 ranks x 2 chunks, its section of schedules_measured.md (~10 min)
run benchmarks/schedules_measured_v.py --rounds 16 --steps 3
run benchmarks/variable_shapes.py
run benchmarks/seq_lengths.py --repeats 5
run benchmarks/metering_cost.py
run benchmarks/rng_cost.py -o benchmarks/rng_cost.md
run benchmarks/startup.py -o benchmarks/startup.md
# real data: the demo's loss curve (about 4 min), then dapple's planned plan vs DDP (about 5 min)
run -m dapple demo --out-dir /tmp/dapple-demo
run benchmarks/train_real.py --demo-summary /tmp/dapple-demo/summary.json
run benchmarks/host_memory.py --rounds 4
