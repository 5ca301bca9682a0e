#!/usr/bin/env bash
# Session 12, call E (< 9.5 min): the layers with the ping-pong forward / data gradient among the autotuner's
# candidates (config cache version 5: every shape re-tuned), as in session 11's call E: Qwen3 and DeepSeek-V3 on both
# routings, GPT-OSS and Mixtral balanced, each with every peer in the same process. Each step under its own timeout.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
bench() {  # NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  echo "== bench moe $name"
  timeout -k 10 "$limit" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --json "$out/$name.json" \
    "$@" > "$out/$name.log" 2>&1
  filter < "$out/$name.log" | grep -E "^(deep|qwen|mixtral|gpt)|Error|skewed over|tuned (fwd|dgrad)" \
    | grep -v "per-expert" | tail -24
}
bench qwen3 110 --shapes qwen3-30b-a3b --reps 5 --warmup 2
bench gptoss 80 --shapes gpt-oss-20b --routing balanced --reps 5 --warmup 2
bench dsv3 170 --shapes deepseek-v3 --reps 5 --warmup 2
bench mixtral 150 --shapes mixtral-8x7b --routing balanced --reps 3 --warmup 1
