#!/usr/bin/env bash
# Session 14, call E (main; < 6 min, what was left of the device time): Mixtral again with the host-ahead floor
# (call C, balanced: 1.07 / 1.01 / 1.02 of its floor, eager / host-ahead / graph), then on skewed routing.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 320 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes mixtral-8x7b \
  --routing balanced,skewed --reps 3 --warmup 1 --json "$out/mixtral-8x7b.json" > "$out/mixtral-8x7b.log" 2>&1
filter < "$out/mixtral-8x7b.log" | grep -E "^mix|Error|over balanced" | grep -v per-expert | tail -22
