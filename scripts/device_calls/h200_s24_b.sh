#!/usr/bin/env bash
# Session 24, call B (< 10 min): DeepSeek-V3's layer with every peer (the torch.compile'd reference included), both
# routings, after the autotuner began timing torch._grouped_mm beside its candidates (call A).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3 balanced,skewed 3 1 560
