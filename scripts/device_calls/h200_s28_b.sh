#!/usr/bin/env bash
# Session 28, call B (< 9.5 min): the routing programs measured in call A at 8 and 32 experts (16 tokens per program):
# the route tests on the GPU, the sweep again with more tokens per program on offer, then Mixtral's layer with the
# compiled reference (last run with it in session 23, at 1.04x: the thinnest "never slower than compiled" margin).
source scripts/device_common.sh "$@"
kernel_tests tests_route 150 tests/kernels/test_route.py
echo "== route at 8 and 32 experts, up to 128 tokens per program"
row_sweep sweep_route_small 100 --shapes mixtral-8x7b,gpt-oss-20b --kernels route,route_bwd --rounds 5
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench mixtral-8x7b balanced 3 1 330
