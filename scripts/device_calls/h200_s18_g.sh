#!/usr/bin/env bash
# Session 18, call G (< 8 min): the layers at Mixtral (both routings, every peer: the eager 3% criterion with the paired
# ratio, and the compiled reference, the closest peer) and DeepSeek-V3 balanced (no compiled reference: its compile
# alone takes minutes) on main as it stands.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== Mixtral layer"
run_bench mixtral-8x7b balanced,skewed 3 1 230
echo "== DeepSeek-V3 layer"
run_bench deepseek-v3 balanced 3 1 200 --no-compile
