#!/usr/bin/env bash
# Session 10, call I (< 5.5 min): which kinds of launch leave the ping-pong weight gradient slow (call H: the wgrad
# 128x128x64/s2/w4/tma/x2 config did; later ones were not told apart), one fresh process each; then the DeepSeek-V3
# layer with the two-programs-per-SM configs out of the autotuner's candidates (scripts/bench_moe_no_x2.py).
source scripts/device_common.sh "$@"
for first in "fwd:128x128x64/s2/w4/tma/x2" "wgrad_gather:128x128x64/s2/w4/tma/x2" "wgrad:256x128x64/s3/w8/tma" \
             "wgrad:128x128x64/s3/w4/ptr/x2"; do
  timeout -k 10 60 python3 scripts/wgrad_state.py --shape dsv3 --layer fc1 --first "$first" 2>&1 | filter | tail -5
done
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 170 python3 scripts/bench_moe_no_x2.py \
  --shapes deepseek-v3 --routing balanced --reps 5 --warmup 2 --backends auto --graphs --host-ahead \
  --json "$out/moe_dsv3_no_x2.json" > "$out/moe_dsv3_no_x2.log" 2>&1
filter < "$out/moe_dsv3_no_x2.log" | grep -E "^deep|Error|tuned|candidates" | tail -24
