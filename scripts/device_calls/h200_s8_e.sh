#!/usr/bin/env bash
# Session 8, call E (< 9 min): every GPU test but the SwiGLU-fusion ones (measured slower in call A and being removed;
# their autotuning compiles took call A's whole test budget), then call C's DeepSeek-V3 weight-gradient sweep with
# the trial configs of 128 rows per reduction step, against torch._grouped_mm, both routings.
source scripts/device_common.sh "$@"
echo "== GPU tests"
timeout -k 10 330 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rf --durations=12 \
  -k "not compiled and not fc1_swiglu and not fc2_dgrad and not swiglu_fusions and not both" 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error|s call|s setup" | tail -24
echo "== deepseek-v3 wgrad"
timeout -k 10 200 python3 -m moetrain bench gemm --shapes dsv3 --ops wgrad --routing balanced,skewed --budget 110 \
  --json "$out/bench_gemm_wgrad.json" 2>&1 | filter | tee "$out/bench_gemm_wgrad.log" | grep -E "TF/s|layer|^dsv3" | tail -24
