#!/usr/bin/env bash
# Session 9, call D (< 9.5 min): every GPU test but the compiled ones on the final code, then the other shapes with
# the fixed peak measurement and the host-ahead rows: the EP8 rank view (both routings, compiled reference), Mixtral
# and GPT-OSS (balanced, no compiled reference: measured in session 7).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 170
echo "== layers"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 190 python3 -m moetrain bench moe \
  --shapes deepseek-v3-ep8 --routing balanced,skewed --reps 5 --warmup 2 --backends auto --graphs --host-ahead \
  --json "$out/moe_ep8.json" > "$out/moe_ep8.log" 2>&1
filter < "$out/moe_ep8.log" | grep -E "^deep|Error" | tail -22
timeout -k 10 100 python3 -m moetrain bench moe --shapes mixtral-8x7b --routing balanced --reps 3 --warmup 1 \
  --backends auto --graphs --host-ahead --no-compile --json "$out/moe_mixtral.json" > "$out/moe_mixtral.log" 2>&1
filter < "$out/moe_mixtral.log" | grep -E "^mixt|Error" | tail -10
timeout -k 10 70 python3 -m moetrain bench moe --shapes gpt-oss-20b --routing balanced --reps 5 --warmup 2 \
  --backends auto --graphs --host-ahead --no-compile --json "$out/moe_gptoss.json" > "$out/moe_gptoss.log" 2>&1
filter < "$out/moe_gptoss.log" | grep -E "^gpt|Error" | tail -10
