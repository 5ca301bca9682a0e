#!/usr/bin/env bash
# Session 10, call C (< 9.5 min): the ping-pong weight gradient joined the autotuner's candidates (calls A, B). Every
# GPU test but the compiled ones (new: each ping-pong config on skewed routing and replayed in a CUDA graph with new
# routing), then the layer at DeepSeek-V3 and Qwen3, both routings, every peer (eager and compiled reference, host
# ahead, graphs, the six torch GEMMs).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 150
echo "== layers"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 240 python3 -m moetrain bench moe --shapes deepseek-v3 \
  --routing balanced,skewed --reps 5 --warmup 2 --backends auto --graphs --host-ahead --json "$out/moe_dsv3.json" \
  > "$out/moe_dsv3.log" 2>&1
filter < "$out/moe_dsv3.log" | grep -E "^deep|Error" | tail -24
timeout -k 10 150 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced,skewed --reps 5 --warmup 2 \
  --backends auto --graphs --host-ahead --json "$out/moe_qwen3.json" > "$out/moe_qwen3.log" 2>&1
filter < "$out/moe_qwen3.log" | grep -E "^qwen|Error" | tail -24
