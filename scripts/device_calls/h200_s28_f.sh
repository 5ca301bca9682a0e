#!/usr/bin/env bash
# Session 28, call F (< 9 min): DeepSeek-V3's layer on both routings with the compiled reference, after the SwiGLU
# kernels' probs load changed (session 27's B and F ran it before; skewed with the compiled reference last in
# session 24).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3 balanced,skewed 3 1 530
