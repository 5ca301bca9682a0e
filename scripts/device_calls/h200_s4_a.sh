#!/usr/bin/env bash
# Session 4, call A (< 8 min): every GPU test (new since session 3: the tensor-core router GEMM, auto's routing
# kernel outside torch.compile), then planner calibration data on configs outside the validation set.
# timeout -k: a hung CUDA process ignores SIGTERM (session 3 lost 9 minutes of device time that way).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 170
# alone, so that a hang (session 3: a compiled layer with the routing kernel inside) costs only this
timeout -k 10 100 python3 -m pytest -q -m gpu tests/unit/test_gpu.py -k compiled -p no:cacheprovider -rf 2>&1 \
  | tee "$out/gpu_compiled.log" | grep -E "passed|failed|FAILED|Error" | tail -4
timeout -k 10 80 python3 -m pytest -q tests/kernels/test_route.py tests/kernels/test_moe_fused.py -p no:cacheprovider -rf 2>&1 \
  | tee "$out/kernel_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== planner calibration (measured vs roofline)"
timeout -k 10 170 python3 scripts/plan_calibrate.py --json "$out/calibrate.json" 2>&1 | grep -Ev "Warning|warn" | cut -c1-300 | tail -24
