#!/usr/bin/env bash
# Session 24, call A (< 10 min): the autotuner with torch._grouped_mm timed beside its candidates (PEER in
# grouped_gemm_tuning.py: a config at least torch's speed on both routings is preferred). (1) its GPU tests;
# (2) DeepSeek-V3's six GEMMs on both routings, every config, then torch, our best and auto in turns (session 20:
# auto's FC2 forward and data gradient 0.99x torch on balanced routing, the six GEMMs 1.09x).
source scripts/device_common.sh "$@"
gpu_test_subset tuner 100 tests/kernels/test_grouped_gemm_gpu.py -k "autotuner or skewed_routing_empty"
run_gemm_bench dsv3 balanced,skewed 300 470
grep -E "auto picked|tuned" "$out/gemm_dsv3.log" | head -30
