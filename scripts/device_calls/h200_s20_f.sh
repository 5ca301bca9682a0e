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
run_gemm_bench qwen3 balanced 80 200
