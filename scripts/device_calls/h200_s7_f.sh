#!/usr/bin/env bash
# Session 7, call F (< 9.5 min): DeepSeek-V3's closing table (call E's ran out of memory: the graphs captured
# for the correctness check kept their pools while the timing drew new inputs), then the routing kernel and the
# combine backward after their rewrite in Qwen3's kernel profile (0.114 / 0.164 ms in call A).
source scripts/device_common.sh "$@"
echo "== bench moe deepseek-v3"
timeout -k 10 400 python3 -m moetrain bench moe --shapes deepseek-v3 --routing balanced,skewed --reps 5 --warmup 2 \
  --backends auto --graphs --json "$out/moe_dsv3.json" 2>&1 | filter | grep -v "^    \[" | grep -Ev "^  (tuned|grouped|moe_)" | tail -24
echo "== qwen3 profile (triton)"
timeout -k 10 130 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced --reps 3 \
  --warmup 1 --backends triton --no-compile --profile 2>&1 | filter | grep -v "^    \[" \
  | grep -E "ours|_route|_combine|_swiglu|^qwen" | cut -c1-300
