#!/usr/bin/env bash
# One-GPU benchmark (benchmarks/gpu.py): MFU of configs/1b_bf16.py and configs/8b_bf16.py
# at ZeRO stage 3 per remat policy (full; by name: 1B five, 8B four), the 8B with its optimizer state offloaded
# to host memory (optimizer.offload=host: device peak and step time beside the run
# without), the 8B with gradient release without and with its params and optimizer state
# in host memory (zero.param_offload, optimizer.offload: the step time the copies cost;
# once more written behind: optimizer.release_write_behind),
# the bf16 Kahan AdamW update's memory bandwidth against the device's peak,
# per-device memory against the planner, and for the 8B in host memory each phase of the
# run (init, checksums, eval, the steps): its device peak beside its compiled bytes.
#
#   bash benchmarks/gpu.sh            # one H200, under 8 minutes -> benchmarks/results/gpu.json
#   bash benchmarks/gpu.sh --cpu      # tiny shapes on CPU, ~1 minute -> benchmarks/results/gpu_cpu.json
#   bash benchmarks/gpu.sh --configs 1b --remat full   # any other gpu.py flag passes through
#
# Without an NVIDIA GPU (no nvidia-smi) it runs the CPU mode. PYTHON picks the
# interpreter (default: python3 on PATH); BUDGET the seconds after which no new
# measurement starts (default 420 on GPU, so the run ends within 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

mode=gpu
for arg in "$@"; do [[ "$arg" == "--cpu" ]] && mode=cpu; done
if [[ "$mode" == gpu ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu.sh: no nvidia-smi, running the CPU mode" >&2
  mode=cpu
  set -- --cpu "$@"
fi

if [[ "$mode" == gpu ]]; then
  # XLA's flags and memory fraction: each measurement applies train.py's GPU profile
  # (zerojax.gpu.xla_flags); one row runs the largest config without it.
  budget="${BUDGET:-420}"
  limit=470   # Hard stop: 7 min 50 s, results so far are already on disk.
else
  export JAX_PLATFORMS=cpu
  budget="${BUDGET:-240}"
  limit=300
fi
exec timeout "$limit" "$PYTHON" benchmarks/gpu.py --budget "$budget" "$@"
