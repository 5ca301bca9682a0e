#!/usr/bin/env bash
# Session 18, call J (< 4.5 min): the weight gradient's "sorted" schedule (groups heaviest first, programs in step;
# call I: 9.78 -> 8.84 ms at DeepSeek-V3's FC1 on the layer's skewed routing) is now an autotuner candidate. Its GPU
# tests, then DeepSeek-V3's layer on both routings (eager and host-ahead, no graphs or compile: the time left).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== GPU tests (sorted)"
gpu_test_subset sorted 80 tests/kernels/test_wgrad_pingpong_gpu.py tests/kernels/test_grouped_gemm_gpu.py \
  -k "sorted or refused or pingpong_wgrad_in_a_cuda_graph"
echo "== DeepSeek-V3 layer"
timeout -k 10 190 python3 -m moetrain bench moe --backends auto --host-ahead --no-compile --shapes deepseek-v3 \
  --routing balanced,skewed --reps 2 --warmup 1 --json "$out/dsv3.json" > "$out/dsv3.log" 2>&1
echo "rc $?"; filter < "$out/dsv3.log" | grep -E "^deep|skewed over|tuned wgrad|Error" | grep -v per-expert | tail -16
