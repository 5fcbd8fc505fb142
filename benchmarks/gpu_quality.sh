#!/usr/bin/env bash
# Quality on one GPU (benchmarks/quality.py, issue 15): configs/125m_quality.py's ~113M
# Llama, 2,000 steps of 8 x 256 tokens, five arms (fp32, bf16 + fp32 master, bf16 +
# Kahan, bf16 + stochastic rounding, plain bf16), seeds 0 and 1: held-out loss minus
# fp32's in nats with the seed spread, and the curves.
#
#   bash benchmarks/gpu_quality.sh     # one H200, under 6 minutes -> benchmarks/results/quality.json, .png
#   bash benchmarks/gpu_quality.sh --steps 1000     # any other quality.py flag passes through
#
# Sizing (not yet measured on a GPU): ~1.4 TFLOP a step; launch-bound at this size, so
# ~10 ms a step is assumed (the 1B step ran at 38% MFU, a 113M one will not) -> 10 runs
# x 2,000 steps ~ 200 s, plus ~5 compiles. Seeds run one after the other through all
# arms and the JSON is written after every run, so the hard stop keeps whole seeds;
# BUDGET (default 240 s) is when no new seed starts. Without an NVIDIA GPU (no
# nvidia-smi) it runs the tiny size on CPU. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
  limit=350   # Hard stop: 5 min 50 s.
  exec timeout "$limit" "$PYTHON" benchmarks/quality.py --budget "${BUDGET:-240}" "$@"
fi
echo "gpu_quality.sh: no nvidia-smi, running the tiny size on CPU" >&2
export JAX_PLATFORMS=cpu
exec timeout 600 "$PYTHON" benchmarks/quality.py --size tiny --steps 50 --budget "${BUDGET:-300}" "$@"
