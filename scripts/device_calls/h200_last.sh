#!/usr/bin/env bash
# Short call: the fixes after scripts/device_calls/h200_validate.sh (auto's torch wgrad layout, event timing
# without do_bench's L2 buffer, fp32 on the torch path, test fixes).
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 75 python3 -m pytest -q tests/kernels/test_moe_rows.py tests/kernels/test_moe_fused_gpu.py -p no:cacheprovider -rf 2>&1 \
  | grep -E "passed|failed|FAILED|Error" | tail -6
timeout 70 python3 -m moetrain plan validate --configs tiny-wide qwen3-fp32 --out "$out/validate" 2>&1 | grep -Ev "Warning|warn" | tail -5
timeout 75 python3 -m moetrain bench moe --shapes mixtral-8x7b,gpt-oss-20b --routing balanced --reps 4 --warmup 2 \
  --backends triton,auto --no-compile 2>&1 | grep -Ev "Warning|warn" | cut -c1-150 | tail -24
