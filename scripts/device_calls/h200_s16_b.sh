#!/usr/bin/env bash
# Session 16, call B (main; < 5 min): what each Triton / Gluon launch of our layer costs the host, piece by piece
# (scripts/launch_cost.py, Qwen3 at 4096 tokens), to decide on a launcher that skips Triton's binder and key; then
# Qwen3's layer at 4096 tokens with every peer (session 15, call G: ours eager 4.19 ms, compiled 4.08) as the baseline.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 150 python3 scripts/launch_cost.py --shapes qwen3-30b-a3b --tokens 4096 > "$out/launch_cost.log" 2>&1
filter < "$out/launch_cost.log" | tail -40
timeout -k 10 110 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes qwen3-30b-a3b \
  --tokens 4096 --routing balanced --reps 5 --warmup 2 --json "$out/qwen3_4096.json" > "$out/qwen3_4096.log" 2>&1
filter < "$out/qwen3_4096.log" | grep -E "^qwen|Error" | grep -v per-expert | tail -11
