#!/usr/bin/env bash
# GPU tests of the fused path, why auto lost to triton on Mixtral / GPT-OSS, and the planner's
# validation against the trainer (which now runs the fused expert path), in one device call.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== GPU tests"
timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rf 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
timeout 60 python3 -m pytest -q tests/kernels/test_moe_rows.py -p no:cacheprovider -rf 2>&1 | tee "$out/rows_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== MoE layer: auto vs triton, with kernel profiles"
timeout 120 python3 -m moetrain bench moe --shapes mixtral-8x7b,gpt-oss-20b --routing balanced --reps 4 --warmup 2 \
  --backends triton,auto --no-compile --profile 2>&1 | grep -Ev "Warning|warn" | cut -c1-170 | tee "$out/auto.log" | grep -v "^    " 
grep -A6 "ours (auto)" "$out/auto.log" | head -16
echo "== plan validate"
timeout 330 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | grep -Ev "Warning|warn" | tail -22
