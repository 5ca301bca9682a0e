#!/usr/bin/env bash
# Session 14, call D (main; < 10 min): the layers again with the host-ahead floor and the fused FC1's backward
# without its zero-filled [M, I]: DeepSeek-V3 and Qwen3 on both routings (peak memory, skew), GPT-OSS balanced again
# (call C: 1.08 / 1.00 / 1.04 of its floor, eager / host-ahead / graph, within a ±5% spread).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench() {  # shape routings reps warmup seconds
  echo "== bench moe $1 $2"
  timeout -k 10 "$5" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes "$1" --routing "$2" \
    --reps "$3" --warmup "$4" --json "$out/$1.json" > "$out/$1.log" 2>&1
  filter < "$out/$1.log" | grep -E "^(deep|gpt|qwen)|Error|over balanced" | grep -v per-expert | tail -22
}
run_bench deepseek-v3 balanced,skewed 5 2 200
run_bench qwen3-30b-a3b balanced,skewed 5 2 170
run_bench gpt-oss-20b balanced 7 2 150
grep -E "moe_fc1_swiglu" "$out"/*.log | sort -u
