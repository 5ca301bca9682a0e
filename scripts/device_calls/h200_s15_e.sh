#!/usr/bin/env bash
# Session 15, call E (main; < 9.5 min): the GEMM criteria again (bench gemm: every config, then torch, our best and
# auto in turns; session 12: ours 1.11x torch on Qwen3's six-GEMM sum, 1.09x at DeepSeek-V3), then GPT-OSS (call C:
# 1.02 / 1.01 / 1.01 of its floor) and DeepSeek-V3 on both routings.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 5 230 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --routing balanced --budget 150 \
  > "$out/gemm.log" 2>&1
filter < "$out/gemm.log" | grep -E "^(dsv3|qwen3)|sum|six|auto" | tail -22
run_bench() {  # shape routing reps warmup timeout
  timeout -k 10 "$5" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes "$1" --routing "$2" \
    --reps "$3" --warmup "$4" --json "$out/$1.json" > "$out/$1.log" 2>&1
  filter < "$out/$1.log" | grep -E "^(deep|gpt)|Error|over balanced" | grep -v per-expert | tail -22
}
run_bench gpt-oss-20b balanced,skewed 7 2 110
run_bench deepseek-v3 balanced,skewed 5 2 210
