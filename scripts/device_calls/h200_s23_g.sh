#!/usr/bin/env bash
# Session 23, call G (< 5 min): Mixtral's layer after direct launches (kernels/launch.py), balanced, every peer but
# the compiled reference.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench mixtral-8x7b balanced 5 1 280 --no-compile
