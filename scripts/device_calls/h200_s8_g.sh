#!/usr/bin/env bash
# Session 8, call G (< 9.5 min): DeepSeek-V3, both routings, every peer including the compiled reference (session
# 7's table lacked it), eager and graphed, with the allocator column (cudaMalloc calls and retries inside the timed
# repetitions: session 7 saw 2.45 ms of GPU idle per eager call at this shape). Expandable segments as in s7_g.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 550 python3 -m moetrain bench moe --shapes deepseek-v3 --routing balanced,skewed --reps 5 \
  --warmup 2 --backends auto --graphs --json "$out/moe_dsv3.json" 2>&1 | filter | grep -v "^    \[" \
  | grep -E "^deep|Error|error|choice|fc1|fc2" | tail -40
