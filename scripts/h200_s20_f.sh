#!/usr/bin/env bash
# Session 20, call F (< 8 min): with the autotuner and auto timing candidates queued, the Mixtral layer on both
# routings (3% criterion; session 19: 1.06 eager and graphed on its machine) and Qwen3's six GEMMs, auto per op
# against torch (session 15: ours 1.13x on the sum).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== mixtral-8x7b"
run_bench mixtral-8x7b balanced,skewed 3 1 240
grep -E "tuned (wgrad|fwd|dgrad)" "$out/mixtral-8x7b.log" | head -12
echo "== bench gemm, Qwen3, balanced"
timeout -k 10 200 python3 -m moetrain bench gemm --shapes qwen3 --routing balanced --budget 80 \
  > "$out/gemm_qwen3.log" 2>&1
echo "rc $?"; filter < "$out/gemm_qwen3.log" | grep -E "^qwen3|^layer|auto picked|ratio" | tail -16
