#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): at most ~9 minutes on a machine with one GPU.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR] [--dry-run]
#   OUT_DIR defaults to $OUT (the device tool's output folder), else out/gpu-check.
#   --dry-run: no GPU needed (CI); CUDA steps are skipped with the reason, the rest runs.
# Installs nothing from a network: dapple is installed into the machine's own python3 with
# --no-deps (its torch, transformers, safetensors, rich, matplotlib and numpy are used as they are).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/gpu-check}"
dry=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry="--dry-run" ;;
    *) out="$arg" ;;
  esac
done
mkdir -p "$out"
PY=${PYTHON:-python3}
if [[ -z "$dry" ]]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
fi
"$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version(), "gpu", torch.cuda.get_device_name(0))
PYEOF
exec "$PY" benchmarks/gpu_check.py --out "$out" $dry
