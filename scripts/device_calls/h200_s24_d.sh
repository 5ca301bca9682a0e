#!/usr/bin/env bash
# Session 24, call D (< 10 min): Qwen3's layer (both routings, every peer, the compiled reference included) and
# Mixtral's (balanced, without it) after the autotuner began timing torch._grouped_mm beside its candidates.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench qwen3-30b-a3b balanced,skewed 5 2 330
run_bench mixtral-8x7b balanced 5 1 230 --no-compile
