#!/usr/bin/env bash
# Session 7, call G (< 5 min): DeepSeek-V3's layer, eager and graphed (call F's run ran out of memory at the
# six-GEMM floor with 18.8 GB reserved but unallocated: expandable segments here; no compiled reference).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 290 python3 -m moetrain bench moe --shapes deepseek-v3 --routing balanced,skewed --reps 5 --warmup 2 \
  --backends auto --graphs --no-compile --json "$out/moe_dsv3.json" 2>&1 | filter | grep -v "^    \[" \
  | grep -E "^deep|Error|error" | tail -16
