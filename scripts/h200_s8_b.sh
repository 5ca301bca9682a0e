#!/usr/bin/env bash
# Next session, call B (< 5 min): the layers with and without FC1 + SwiGLU fused (paired variant), eager and graphed.
source scripts/device_common.sh "$@"
timeout -k 5 280 python3 -m moetrain bench moe --shapes mixtral-8x7b,gpt-oss-20b,qwen3-30b-a3b --routing balanced \
  --reps 3 --warmup 1 --backends triton --fc1-swiglu --no-compile --graphs 2>&1 | filter \
  | grep -E "^mixtral|^gpt|^qwen3|Error" | tail -24
