#!/usr/bin/env bash
# Session 7, call E (< 9.5 min): the closing table of #6 for DeepSeek-V3 (both routings), Mixtral and GPT-OSS:
# eager and graphed, against the eager and compiled references and the six-GEMM floor, in one process per shape.
source scripts/device_common.sh "$@"
echo "== bench moe deepseek-v3"
timeout -k 10 300 python3 -m moetrain bench moe --shapes deepseek-v3 --routing balanced,skewed --reps 5 --warmup 2 \
  --backends auto --graphs --json "$out/moe_dsv3.json" 2>&1 | filter | grep -v "^    \[" | tail -30
echo "== bench moe mixtral, gpt-oss"
timeout -k 10 250 python3 -m moetrain bench moe --shapes mixtral-8x7b,gpt-oss-20b --routing balanced --reps 5 \
  --warmup 2 --backends auto --graphs --json "$out/moe_mixtral_gptoss.json" 2>&1 | filter | grep -v "^    \[" | tail -30
