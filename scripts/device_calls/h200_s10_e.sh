#!/usr/bin/env bash
# Session 10, call E (< 6 min): the autotuner kept our Triton kernel at DeepSeek-V3's FC1 weight gradient in the layer
# and in bench gemm (call D), where the ping-pong kernel was 1.17x faster in the same process's sweep: what the
# autotuner measured for each candidate, then its pick against the ping-pong configs in turns. Then the EP8 rank
# view's layer (both routings, every peer).
source scripts/device_common.sh "$@"
echo "== autotuner probe"
n=0
for args in "--layer fc1" "--layer fc1 --routing skewed" "--layer fc2"; do
  n=$((n + 1))
  timeout -k 10 120 python3 scripts/autotune_probe.py --shape dsv3 $args > "$out/probe$n.log" 2>&1
  filter < "$out/probe$n.log" | tail -20
done
echo "== layer"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 200 python3 -m moetrain bench moe \
  --shapes deepseek-v3-ep8 --routing balanced,skewed --reps 5 --warmup 2 --backends auto --graphs --host-ahead \
  --json "$out/moe_ep8.json" > "$out/moe_ep8.log" 2>&1
filter < "$out/moe_ep8.log" | grep -E "^deep|Error|tuned" | tail -30
