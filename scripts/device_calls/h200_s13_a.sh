#!/usr/bin/env bash
# Session 13, call A: FC1's forward with SwiGLU in the ping-pong epilogue. GPU tests (the kernel against float64 and
# the separate kernels, CUDA-graph replay; the layer with the fused variant forced, and auto's measurement), then the
# kernel against the separate paths in turns, then the Qwen3 layer with auto choosing between the two.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset fused_tests 240 tests/kernels/test_rowgroup_pingpong_gpu.py tests/kernels/test_moe_fused_gpu.py \
  -k "not compiled" || exit 1
echo "== FC1 + SwiGLU: separate vs fused"
timeout -k 5 150 python3 scripts/fc1_swiglu_bench.py --shapes qwen3,gptoss,dsv3,mixtral --rounds 3 \
  > "$out/fc1_swiglu.log" 2>&1
filter < "$out/fc1_swiglu.log" | tail -6
echo "== Qwen3 layer"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 200 python3 -m moetrain bench moe --backends auto \
  --graphs --host-ahead --shapes qwen3-30b-a3b --routing balanced,skewed --reps 5 --warmup 2 > "$out/qwen3.log" 2>&1
filter < "$out/qwen3.log" | tail -40
