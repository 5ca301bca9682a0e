#!/usr/bin/env bash
# Next device call (< 10 min): everything session 2 built but could not run on a GPU, and a fresh,
# out-of-sample planner validation with the refitted host constants.
#   1. GPU tests: -m gpu (fused path incl. auto's FC1 gather/copy choice, graph capture, trainer) and the
#      row / routing kernels in bf16 and fp32 (tests/kernels/test_moe_rows.py, test_route.py)
#   2. moetrain plan validate, all 12 configs (results packed into one file)
#   3. the MoE layer at Qwen3 and DeepSeek-V3 with kernel profiles of the fused path
# Usage on the GPU machine from the repo root: bash scripts/h200_next.sh [OUT_DIR]
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== GPU tests"
timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rf 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -8
timeout 60 python3 -m pytest -q tests/kernels/test_moe_rows.py tests/kernels/test_route.py -p no:cacheprovider -rf 2>&1 \
  | tee "$out/row_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== plan validate"
timeout 300 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | grep -Ev "Warning|warn" | tail -16
tar czf "$out/validate.tgz" -C "$out" validate && rm -rf "$out/validate"
echo "== MoE layer with profiles"
timeout 120 python3 -m moetrain bench moe --shapes qwen3-30b-a3b,deepseek-v3 --routing balanced --reps 4 --warmup 2 \
  --backends triton,auto --no-compile --profile 2>&1 | grep -Ev "Warning|warn" | cut -c1-150 | tee "$out/profile.log" | tail -60
