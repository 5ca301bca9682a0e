#!/usr/bin/env bash
# Session 28, call D (< 7 min): Qwen3's layer on both routings with the compiled reference (the SwiGLU kernels'
# probs load changed in call A's commit; session 27's call C ran the same command before it).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench qwen3-30b-a3b balanced,skewed 5 2 400
