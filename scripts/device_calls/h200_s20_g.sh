#!/usr/bin/env bash
# Session 20, call G (< 7 min): the GPU tests of what this session changed (the autotuner and auto timing candidates
# queued, no tail-split preference): the grouped GEMM, fused-path and unit GPU tests (compiled-model tests apart).
source scripts/device_common.sh "$@"
gpu_test_subset changed 380 tests/kernels/test_grouped_gemm_gpu.py tests/kernels/test_moe_fused_gpu.py \
  tests/unit/test_gpu.py -k "not compiled"
