#!/usr/bin/env bash
# Session 8, call K (< 3.5 min, the session's last device time): Qwen3 with the compiled reference in the same run
# as ours on the final code (call I ran it --no-compile), both routings, eager and graphed.
source scripts/device_common.sh "$@"
timeout -k 5 170 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced,skewed --reps 3 --warmup 1 \
  --backends triton,auto --graphs --json "$out/moe_qwen3.json" 2>&1 | filter | grep -E "^qwen3|Error|failed" | tail -20
