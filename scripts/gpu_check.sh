#!/usr/bin/env bash
# GPU checks for a lent accelerator (never in CI): engine == AR on CUDA (tiny models, default
# target fp32 + bf16), the distributed runtime on NCCL on that GPU, and per-part times as JSON.
# Usage: scripts/gpu_check.sh [tiny] [default] [distributed]   (all three by default)
# Fails (exit 1) on any token mismatch; bounded to 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "gpu_check: no nvidia-smi" >&2; exit 1; }
timeout 480 python scripts/gpu_check.py "$@"
