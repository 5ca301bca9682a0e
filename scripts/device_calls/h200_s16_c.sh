#!/usr/bin/env bash
# Session 16, call C (main; < 8 min): the host time after choose's memo and the direct call outside compilation
# (call A: Qwen3 host forward 1.315 ms + backward 2.329), at the full shape and at 4096 tokens; Qwen3 at 4096 tokens
# with every peer (call B: ours eager 5.08 ms, compiled 4.42); then where Mixtral's and GPT-OSS's eager calls idle
# (timeline of bench moe --profile: session 15 measured ours eager 1.05-1.06 / 1.02-1.05 of the floor against
# 1.00-1.02 host-ahead).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 100 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b --calls 20 > "$out/host_full.log" 2>&1
timeout -k 10 80 python3 scripts/host_breakdown.py --shapes qwen3-30b-a3b --calls 20 --tokens 4096 \
  > "$out/host_4096.log" 2>&1
grep -hE "^== " "$out/host_full.log" "$out/host_4096.log"
timeout -k 10 110 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes qwen3-30b-a3b \
  --tokens 4096 --routing balanced --reps 5 --warmup 2 --json "$out/qwen3_4096.json" > "$out/qwen3_4096.log" 2>&1
filter < "$out/qwen3_4096.log" | grep -E "^qwen|Error" | grep -v per-expert | tail -11
for shape in gpt-oss-20b mixtral-8x7b; do
  timeout -k 10 150 python3 -m moetrain bench moe --backends auto --no-compile --host-ahead --profile --shapes $shape \
    --routing balanced --reps 3 --warmup 1 > "$out/${shape}_profile.log" 2>&1
  filter < "$out/${shape}_profile.log" | grep -E "^(gpt|mix)|timeline|Error" | grep -v per-expert | tail -12
done
