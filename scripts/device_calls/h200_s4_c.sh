#!/usr/bin/env bash
# Session 4, call C (< 6 min): the two GPU tests call A failed (a stale cache-key list; a CUDA graph capture of our
# layer's backward), the router parts under capture, then planner calibration with each layer and the head timed alone.
source scripts/device_common.sh "$@"
echo "== GPU tests"
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_fused_gpu.py \
  "tests/unit/test_gpu.py::test_bench_graphed_contender_replays_the_eager_result" \
  tests/unit/test_gpu.py -k "auto_measures or graph or router_parts or tensor_core" 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== planner calibration (measured vs roofline), components"
timeout -k 10 240 python3 scripts/plan_calibrate.py --json "$out/calibrate.json" 2>&1 | grep -Ev "Warning|warn" | cut -c1-260 | tail -60
