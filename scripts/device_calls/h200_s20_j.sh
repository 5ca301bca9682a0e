#!/usr/bin/env bash
# Session 20, call J (< 3 min): Mixtral's layer again, balanced, more repetitions, no compiled reference: whether
# call F's eager row (1.08 of the floor, 3.3 ms over host-ahead against 0.55 ms in session 19) repeats.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench mixtral-8x7b balanced 5 1 170 --no-compile
