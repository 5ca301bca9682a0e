#!/usr/bin/env bash
# Session 5, call A (< 9.5 min): GPU tests; the weight gradient under skew, in bands of 1/4/8/16 dw row tiles
# (bench/NOTES.md, "Open"); the MoE layer at the two shapes of the 3% targets, with the bf16 router weight.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 170
echo "== weight gradient by routing layout (DeepSeek-V3 FC1, then FC2)"
timeout -k 10 110 python3 scripts/wgrad_skew.py 2>&1 | filter | tee "$out/wgrad_skew.log" | tail -7
timeout -k 10 80 python3 scripts/wgrad_skew.py --n 7168 --k 2048 2>&1 | filter | tee -a "$out/wgrad_skew.log" | tail -6
echo "== MoE layer, Mixtral / GPT-OSS"
timeout -k 10 180 python3 -m moetrain bench moe --shapes mixtral-8x7b,gpt-oss-20b --routing balanced \
  --reps 5 --warmup 2 --backends triton,auto --json "$out/bench_moe.json" 2>&1 | filter | grep -v "^  " \
  | tee "$out/bench_moe.log" | tail -20
