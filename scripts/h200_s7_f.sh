#!/usr/bin/env bash
# Session 7, call F (< 4 min): the routing kernel and the combine backward after their rewrite, in the kernel
# profile of our layer (they took 0.114 / 0.164 ms at Qwen3 and 0.061 / 0.437 ms at DeepSeek-V3 in calls A, B).
source scripts/device_common.sh "$@"
timeout -k 10 200 python3 -m moetrain bench moe --shapes qwen3-30b-a3b,deepseek-v3 --routing balanced --reps 3 \
  --warmup 1 --backends triton --no-compile --profile 2>&1 | filter | grep -v "^    \[" \
  | grep -E "ours|_route|_combine|_swiglu|timeline|^qwen|^deep|ms of kernels" | cut -c1-400
