#!/usr/bin/env bash
# Session 22, call F (< 10 min): DeepSeek-V3's layer with every peer, the torch.compile'd reference included (the
# runs since session 16 left it out with --no-compile), both routings.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3 balanced,skewed 3 1 570
