#!/usr/bin/env bash
# Session 25, call B (< 9 min): the ping-pong forward gathering A's rows by TMA row copies from four loader warps
# (kernels/row_gather.py). Its GPU tests (bits equal to the copied rows' at every tile shape, the fused FC1 + SwiGLU
# gathering, the layer with fused_gather in eager and in a CUDA graph), the grouped GEMM's GPU tests (the tuner now
# offers the gathered ping-pong for moe_fc1_fwd's "gather"), then scripts/fc1_gather_bench.py at four shapes.
source scripts/device_common.sh "$@"
gpu_test_subset rowgroup 240 tests/kernels/test_rowgroup_pingpong_gpu.py
gpu_test_subset fused 240 tests/kernels/test_moe_fused_gpu.py
gpu_test_subset gemm 200 tests/kernels/test_grouped_gemm_gpu.py
echo "== fc1 gather bench"
timeout -k 10 240 python3 scripts/fc1_gather_bench.py --shapes qwen3-30b-a3b,gpt-oss-20b,deepseek-v3,mixtral-8x7b \
  --reps 7 2>&1 | filter
