#!/usr/bin/env bash
# Session 27, call F (< 8 min): DeepSeek-V3's layer on balanced routing with the compiled reference (call B ran it
# without; last with it in session 24), through bench moe's new "range" column.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench deepseek-v3 balanced 3 1 450
