#!/usr/bin/env bash
# Session 3, call D (< 8 min): GPU tests of the model with auto's routing kernel; planner calibration data on
# configs outside the validation set; the grouped GEMM sweep with its interleaved final timing.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== GPU tests (model, trainer, fused path)"
timeout 100 python3 -m pytest -q -m gpu tests/unit/test_gpu.py -p no:cacheprovider -rf 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
timeout 60 python3 -m pytest -q tests/kernels/test_moe_fused.py tests/kernels/test_route.py -p no:cacheprovider -rf 2>&1 \
  | tee "$out/fused_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== planner calibration"
timeout 200 python3 scripts/plan_calibrate.py --json "$out/calibrate.json" 2>&1 | grep -Ev "Warning|warn" | tail -12
echo "== grouped GEMM sweep (interleaved final timing)"
timeout 170 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --ops fwd,dgrad,wgrad --routing balanced,skewed \
  --budget 150 --json "$out/sweep.json" > "$out/sweep.log" 2>&1; grep -A40 "^shape " "$out/sweep.log" | head -40
