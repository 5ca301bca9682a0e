#!/usr/bin/env bash
# Session 19, call I (< 4 min): Qwen3's layer after the one-launch sorted schedule (call H: sorted now level with plain
# on balanced routing and 9-11% faster on skewed), both routings, with which weight-gradient configs the tuner took.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench qwen3-30b-a3b balanced,skewed 5 2 200
grep -E "tuned (wgrad|fwd|dgrad)" "$out/qwen3-30b-a3b.log" | head -12
