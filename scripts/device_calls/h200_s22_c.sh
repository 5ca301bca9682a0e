#!/usr/bin/env bash
# Session 22, call C (< 9 min): DeepSeek-V3's EP8 rank view (32 local experts, 65536 routed rows), every peer, both
# routings; last timed as a layer in session 11 (skewed +11.7% over balanced there). The code is main's (session 20's
# kernels).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3-ep8 balanced,skewed 5 2 520
