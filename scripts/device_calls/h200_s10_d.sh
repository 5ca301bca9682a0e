#!/usr/bin/env bash
# Session 10, call D (< 9 min): with the ping-pong weight gradient among the autotuner's candidates, the six grouped
# GEMMs of a layer at DeepSeek-V3 and Qwen3 (every config, torch, our best and auto in turns: the 1.1x claim), then
# the Mixtral and GPT-OSS layers (balanced; their compiled reference was slower than the eager one in session 7).
source scripts/device_common.sh "$@"
echo "== six GEMMs"
timeout -k 10 280 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --routing balanced --budget 200 \
  --json "$out/bench_gemm.json" > "$out/bench_gemm.log" 2>&1
filter < "$out/bench_gemm.log" | grep -vE "^\s+[0-9]+x|^\s+pingpong|^\[" | tail -24
echo "== layers"
timeout -k 10 110 python3 -m moetrain bench moe --shapes mixtral-8x7b --routing balanced --reps 3 --warmup 1 \
  --backends auto --graphs --host-ahead --no-compile --json "$out/moe_mixtral.json" > "$out/moe_mixtral.log" 2>&1
filter < "$out/moe_mixtral.log" | grep -E "^mixt|Error" | tail -10
timeout -k 10 80 python3 -m moetrain bench moe --shapes gpt-oss-20b --routing balanced --reps 5 --warmup 2 \
  --backends auto --graphs --host-ahead --no-compile --json "$out/moe_gptoss.json" > "$out/moe_gptoss.log" 2>&1
filter < "$out/moe_gptoss.log" | grep -E "^gpt|Error" | tail -10
