#!/usr/bin/env bash
# Next session, call A (< 10 min): GPU tests of everything session 2 built on CPU, and a fresh,
# out-of-sample planner validation with the refitted host constants.
#   GPU tests: -m gpu (fused path incl. auto's FC1 gather/copy choice, wgrad with gathered rows, graph
#   capture, trainer) and the row / routing kernels in bf16 and fp32; then plan validate (12 configs).
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== GPU tests"
timeout 160 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rf 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -8
timeout 60 python3 -m pytest -q tests/kernels/test_moe_rows.py tests/kernels/test_route.py -p no:cacheprovider -rf 2>&1 \
  | tee "$out/row_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== plan validate"
timeout 300 python3 -m moetrain plan validate --out "$out/validate" 2>&1 | grep -Ev "Warning|warn" | tail -16
tar czf "$out/validate.tgz" -C "$out" validate && rm -rf "$out/validate"
