#!/usr/bin/env bash
# Next session, call B (< 8 min): Qwen3's SwiGLU fusions alone, then the layers with and without them (SwiGLU into
# FC1's epilogue, its backward into FC2's data gradient, both), eager and graphed, in one process per shape.
source scripts/device_common.sh "$@"
timeout -k 5 130 python3 scripts/swiglu_fusion_alone.py --shape qwen3-30b-a3b --gather --rounds 3 2>&1 | filter | head -70
timeout -k 5 300 python3 -m moetrain bench moe --shapes mixtral-8x7b,gpt-oss-20b,qwen3-30b-a3b --routing balanced \
  --reps 3 --warmup 1 --backends triton --swiglu-fusion fc1,fc2,both --no-compile --graphs 2>&1 | filter \
  | grep -E "^mixtral|^gpt|^qwen3|Error" | tail -30
