#!/usr/bin/env bash
# Session 27, call C (< 8 min): the route backward's new program at 256 experts (call B: 1 token on 1 warp, 9.8 ->
# 7.9 us): the route tests on the GPU; then Qwen3's layer on both routings with every peer, the compiled reference
# included (skewed not re-run since session 24; the row kernels changed in session 26).
source scripts/device_common.sh "$@"
kernel_tests tests_route 150 tests/kernels/test_route.py
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench qwen3-30b-a3b balanced,skewed 5 2 340
