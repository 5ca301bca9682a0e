#!/usr/bin/env bash
# Session 20, call D (< 9 min): the autotuner and auto timing candidates queued, without the tail-split preference
# (call C: timed from an idle GPU the ping-pong lost picks it wins queued by 5-13%; the split configs trailed the same
# config unsplit by 0-9% on every routing). (1) DeepSeek-V3's six GEMMs, auto per op against torch (session 18: FC1
# forward and data gradient 0.98-0.99, where the split config was picked); (2) Qwen3's layer on both routings.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== bench gemm, DeepSeek-V3, balanced"
run_gemm_bench dsv3 balanced 120 270
echo "== Qwen3 layer, balanced and skewed"
run_bench qwen3-30b-a3b balanced,skewed 5 2 220
grep -E "tuned (wgrad|fwd|dgrad)" "$out/qwen3-30b-a3b.log" | head -12
