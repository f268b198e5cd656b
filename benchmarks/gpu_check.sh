#!/usr/bin/env bash
# The GPU check v2 (benchmarks/gpu_check.py): two parts of under 10 minutes each on a machine with
# one GPU and 16 cores, as two device calls or as one call that runs both side by side.
#
# Usage: bash benchmarks/gpu_check.sh [gpu|cpu|both] [OUT_DIR] [--dry-run]
#   gpu   the GPU steps (realistic Llama-3-8B shapes, analytic vs measured layers, torch.profiler
#         tables, the small-model steps) on cores $GPU_CORES (default: all; 0-3 beside cpu)
#   cpu   fidelity.py and vs_torch_pipelining.py, pinned to cores $CPU_CORES (default 4-15 on
#         16+ cores; the 4 ranks share them, DAPPLE_PIN_CORES=1)
#   both  (default) both at once, each on its own cores: one device call of under 10 minutes
#   OUT_DIR defaults to $OUT (the device tool's output folder), else out/gpu-check.
#   --dry-run  no GPU needed (CI): every GPU step on the CPU at tiny shapes, both parts in turn.
#
# What comes back: OUT/<part>.md (the report) and OUT/<part>.tar.gz (every input and output:
# profiles, calibration, cluster, plans, HF configs, step logs, torch.profiler tables and
# traces), and OUT/gpu_check.log. When OUT_DIR is the device's $OUT (not given), the parts' own
# folders are kept outside it (/tmp/dapple-gpu-check): the device returns at most 8 files.
#
# transformers: dapple needs >= 5.23 (pyproject's hf extra); the device image has 5.17, which
# fails inside an HF LLaMA's rotary embedding under bf16 (dapple now refuses it in one line).
# Carry a wheel (the device has no network), once, here, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp -d .whl 'transformers==5.24.0'
# (transformers is pure Python: one py3-none-any wheel, about 12 MiB; its dependencies are on
# the image.) Then the device call names `.whl` in carry and runs:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
#   bash benchmarks/gpu_check.sh both
# benchmarks/README.md ("GPU check v2") says the same.
set -uo pipefail
cd "$(dirname "$0")/.."
part="both"
out=""
dry=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry="--dry-run" ;;
    gpu|cpu|both) part="$arg" ;;
    *) out="$arg" ;;
  esac
done
work_args=()
if [[ -z "$out" ]]; then
  out="${OUT:-out/gpu-check}"
  if [[ -n "${OUT:-}" ]]; then work_args=(--work /tmp/dapple-gpu-check); fi
fi
mkdir -p "$out"
PY=${PYTHON:-python3}
log="$out/gpu_check.log"
if [[ -z "$dry" ]]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'available', torch.cuda.is_available(), 'transformers', transformers.__version__)" 2>&1 | tee -a "$log"

ncores=$(nproc --all 2>/dev/null || echo 1)
pinned() {  # pinned CORES CMD...: CMD on CORES when this machine has 16 cores or more
  local cores="$1"; shift
  if [[ "$ncores" -ge 16 ]] && command -v taskset >/dev/null; then taskset -c "$cores" "$@"; else "$@"; fi
}
gpu_cores="${GPU_CORES:-0-$((ncores - 1))}"  # alone: every core; beside the CPU part: 0-3
gpu_part() { pinned "$gpu_cores" "$PY" benchmarks/gpu_check.py --part gpu --out "$out" ${work_args[@]+"${work_args[@]}"} $dry; }
cpu_part() { pinned "${CPU_CORES:-4-15}" "$PY" benchmarks/gpu_check.py --part cpu --out "$out" ${work_args[@]+"${work_args[@]}"} $dry; }

case "$part" in
  gpu) gpu_part 2>&1 | tee -a "$log" ;;
  cpu) cpu_part 2>&1 | tee -a "$log" ;;
  both)
    gpu_cores="${GPU_CORES:-0-3}"
    if [[ -n "$dry" ]]; then  # CI's 2 cores: one part after the other
      gpu_part 2>&1 | tee -a "$log"; rc=$?
      cpu_part 2>&1 | tee -a "$log"; exit $(( rc || $? ))
    fi
    cpu_part >"$out/cpu_part.log" 2>&1 &
    cpu_pid=$!
    gpu_part 2>&1 | tee -a "$log"; rc=$?
    wait "$cpu_pid"; rc2=$?
    cat "$out/cpu_part.log" >>"$log"; rm -f "$out/cpu_part.log"
    exit $(( rc || rc2 ))
    ;;
esac
