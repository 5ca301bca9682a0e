#!/usr/bin/env bash
# Session 28, call C (< 9 min): GPT-OSS's layer on both routings with the compiled reference (session 27 ran it
# without; the routing program at 32 experts changed in call A's commit).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench gpt-oss-20b balanced,skewed 5 1 500
