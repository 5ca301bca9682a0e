#!/usr/bin/env bash
# Session 27, call B (< 9.5 min): the route's new measured programs (call A: 1 token on 1 warp at 256 experts, with
# and without groups; 4 tokens on 2 warps with groups at 128): the route tests on the GPU; the backward swept with
# the same new candidates (1 token, 1 warp); then DeepSeek-V3's layer on both routings without the compiled
# reference (not re-run since session 24; the row kernels changed in session 26, the route in this session).
source scripts/device_common.sh "$@"
kernel_tests tests_route 150 tests/kernels/test_route.py
echo "== routing backward, deepseek-v3 and qwen3"
row_sweep sweep_route_bwd 90 --shapes deepseek-v3,qwen3-30b-a3b --kernels route_bwd,route --rounds 5
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3 balanced,skewed 3 1 410 --no-compile
