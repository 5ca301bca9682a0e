#!/usr/bin/env bash
# Session 27, call A (< 9.5 min): the routing kernel on one two-dimensional tile (the group scores a reshaped view,
# the kept groups a compare per slot): its GPU tests, including the 2-token programs with expert groups that picked
# experts past E on session 26's tile; DeepSeek-V3's own grouped routing swept against torch; then the EP8 rank
# view's layer on both routings (not re-run since session 24; the row kernels changed in session 26).
source scripts/device_common.sh "$@"
kernel_tests tests_route 150 tests/kernels/test_route.py
echo "== grouped and plain routing, deepseek-v3 and qwen3"
row_sweep sweep_route 150 --shapes deepseek-v3,qwen3-30b-a3b --kernels route_grouped,route --rounds 5
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3-ep8 balanced,skewed 3 1 270 --no-compile
