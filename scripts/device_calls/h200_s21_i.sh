#!/usr/bin/env bash
# Session 21, call I (< 6 min): the layers on main at the session's end (no kernel changed this session: every trial
# was taken out again), every peer in the same run: DeepSeek-V3 and Qwen3 on both routings.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== DeepSeek-V3"
run_bench deepseek-v3 balanced,skewed 3 1 220 --no-compile
echo "== Qwen3"
run_bench qwen3-30b-a3b balanced,skewed 5 2 170
