#!/usr/bin/env bash
# Session 27, call D (< 9.5 min): GPT-OSS's and Mixtral's layers on both routings without the compiled reference
# (skewed last run in session 23; the row kernels changed in session 26).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench gpt-oss-20b balanced,skewed 5 1 250 --no-compile
run_bench mixtral-8x7b balanced,skewed 3 1 300 --no-compile
