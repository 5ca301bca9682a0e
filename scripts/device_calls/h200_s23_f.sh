#!/usr/bin/env bash
# Session 23, call F (< 9 min): the layers after direct launches (kernels/launch.py), every peer: Qwen3 (both
# routings, the compiled reference included) and GPT-OSS (balanced, without it).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench qwen3-30b-a3b balanced,skewed 5 2 330
run_bench gpt-oss-20b balanced 7 2 200 --no-compile
