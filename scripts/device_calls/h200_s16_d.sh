#!/usr/bin/env bash
# Session 16, call D (main; < 9.5 min): which host code GPT-OSS's eager call waits on (scripts/gap_sources.py; call C:
# 1.14 ms idle of 16.1, 0.35 before the first kernel); then the final code's layers at Qwen3 (both routings) and
# DeepSeek-V3 with every peer in the run, and the six GEMMs at both (auto per op against torch).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 60 python3 scripts/gap_sources.py --shapes gpt-oss-20b --first 45 > "$out/gaps_gptoss.log" 2>&1
filter < "$out/gaps_gptoss.log" | tail -60
run_bench() {  # shape routing reps warmup timeout
  timeout -k 10 "$5" python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes "$1" --routing "$2" \
    --reps "$3" --warmup "$4" --json "$out/$1.json" > "$out/$1.log" 2>&1
  filter < "$out/$1.log" | grep -E "^(deep|gpt|qwen|mix)|Error" | grep -v per-expert | tail -24
}
run_bench qwen3-30b-a3b balanced,skewed 5 2 150
run_bench deepseek-v3 balanced 5 2 190
timeout -k 10 120 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --routing balanced --budget 100 \
  > "$out/gemm.log" 2>&1
filter < "$out/gemm.log" | grep -A20 "^shape" | head -20
