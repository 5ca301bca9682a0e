#!/usr/bin/env bash
# Session 28, call I (< 4.5 min, the session's last device time): Mixtral's layer on skewed routing with the compiled
# reference (the one shape and routing of #6's table that B-F did not run).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench mixtral-8x7b skewed 3 1 240
