#!/usr/bin/env bash
# Session 28, call E (< 9 min): the EP8 rank view's layer on both routings with the compiled reference (last run with
# it in session 22).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3-ep8 balanced,skewed 3 1 520
