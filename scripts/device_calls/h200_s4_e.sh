#!/usr/bin/env bash
# Session 4, call E (< 6 min): every GPU test again (the routing kernel's written-out backward, auto timing each
# grouped GEMM on the caller's and a skewed routing), the routing kernel tests on the GPU, then the DeepSeek-V3 layer
# (where auto's uniform-routing choice lost 11% to triton on skewed routing), without the compiled reference.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 160
timeout -k 10 60 python3 -m pytest -q tests/kernels/test_route.py -p no:cacheprovider -rf 2>&1 | tee "$out/route_tests.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -4
echo "== MoE layer, DeepSeek-V3"
timeout -k 10 170 python3 -m moetrain bench moe --shapes deepseek-v3 --routing balanced,skewed --reps 5 --warmup 2 \
  --backends triton,auto --no-compile --json "$out/bench_moe_dsv3.json" 2>&1 \
  | grep -Ev "Warning|warn|softmax|Inductor|important use" | tee "$out/bench_moe_dsv3.log" | tail -24
