#!/usr/bin/env bash
# Session 13, call B: the fused FC1 + SwiGLU with 5 stages (g's buffer reused for a). Its GPU tests, the kernel against
# the separate paths (and the plain ping-pong forward alone + SwiGLU: the fusion's own cost), the GPT-OSS layer.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_test_subset fused_tests 150 tests/kernels/test_rowgroup_pingpong_gpu.py tests/kernels/test_moe_fused_gpu.py \
  -k "fc1_with_swiglu or fused_fc1 or auto_measures" || exit 1
echo "== FC1 + SwiGLU: separate vs fused"
timeout -k 5 200 python3 scripts/fc1_swiglu_bench.py --shapes qwen3,gptoss,dsv3,mixtral --rounds 3 \
  > "$out/fc1_swiglu.log" 2>&1
filter < "$out/fc1_swiglu.log" | tail -6
echo "== GPT-OSS layer"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 200 python3 -m moetrain bench moe --backends auto \
  --graphs --host-ahead --shapes gpt-oss-20b --routing balanced --reps 5 --warmup 2 > "$out/gptoss.log" 2>&1
filter < "$out/gptoss.log" | grep -E "gpt-oss|moe_fc1|skewed over" | tail -24
