#!/usr/bin/env bash
# Session 28, call G (< 9.5 min): the six GEMMs at DeepSeek-V3 and Qwen3 on both routings (the grouped GEMM kernels are
# session 24's; last measured there), then the fused layer's GPU tests (the SwiGLU kernels changed this session).
source scripts/device_common.sh "$@"
run_gemm_bench dsv3 balanced,skewed 200 250
run_gemm_bench qwen3 balanced,skewed 150 140
gpu_test_subset fused_layer 140 tests/kernels/test_moe_fused_gpu.py tests/kernels/test_moe_layer_triton.py
