#!/usr/bin/env bash
# Session 20, call A (< 9 min): session 19's six ping-pong weight-gradient candidates (three of them sorted) on the
# GPU: the graph-replay and trial-config tests that now cover them, then the Qwen3 and DeepSeek-V3 layers on both
# routings with the configs the autotuner took (session 19 measured neither layer with the new candidates).
source scripts/device_common.sh "$@"
echo "== tests"
gpu_test_subset wgrad 170 tests/kernels/test_grouped_gemm_gpu.py tests/kernels/test_wgrad_pingpong_gpu.py \
  -k "pingpong_wgrad_in_a_cuda_graph or trial or sorted"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== qwen3"
run_bench qwen3-30b-a3b balanced,skewed 5 2 170
grep -E "tuned (wgrad|fwd|dgrad)" "$out/qwen3-30b-a3b.log" | head -12
echo "== deepseek-v3"
run_bench deepseek-v3 balanced,skewed 3 1 200 --no-compile
grep -E "tuned (wgrad|fwd|dgrad)" "$out/deepseek-v3.log" | head -12
