#!/usr/bin/env bash
# Session 17, call D (< 9.5 min): with x_perm written token by token, Mixtral's layer on both routings with every peer,
# then GPT-OSS's skewed routing (its balanced one ran in call C).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== Mixtral layer, balanced and skewed"
run_bench mixtral-8x7b balanced,skewed 3 1 300
echo "== GPT-OSS layer, skewed"
run_bench gpt-oss-20b skewed 5 2 120
