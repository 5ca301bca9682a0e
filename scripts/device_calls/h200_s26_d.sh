#!/usr/bin/env bash
# Session 26, call D (< 9.8 min): after call C, the route's measured programs only without expert groups (2 tokens
# per program picked experts past E on the group-limited path). The row, route and sort tests on the GPU; the fused
# layer's GPU tests (C's run stopped at its time limit before them); then GPT-OSS's and Mixtral's layers with their
# peers (the SwiGLU backward's new program is their largest row-pass change).
source scripts/device_common.sh "$@"
timeout -k 10 100 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_rows.py \
  tests/kernels/test_route.py tests/kernels/test_sort_rows.py > "$out/tests_rows.log" 2>&1
echo "row tests rc $?"; grep -E "passed|failed|FAILED" "$out/tests_rows.log" | tail -8
timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_fused_gpu.py \
  tests/kernels/test_moe_layer_triton.py > "$out/tests_layer.log" 2>&1
echo "layer tests rc $?"; grep -E "passed|failed|FAILED" "$out/tests_layer.log" | tail -8
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench gpt-oss-20b balanced 5 1 120 --no-compile
run_bench mixtral-8x7b balanced 3 1 140 --no-compile
