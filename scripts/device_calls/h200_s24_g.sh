#!/usr/bin/env bash
# Session 24, call G (< 9 min): GPT-OSS's layer (balanced) and DeepSeek-V3's EP8 rank view (both routings), without
# the compiled reference (session 22: EP8 ran 1.23-1.25x under it), after the autotuner began timing
# torch._grouped_mm beside its candidates: with calls B and D, every benchmark shape's layer after the change.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run_bench gpt-oss-20b balanced 7 2 190 --no-compile
run_bench deepseek-v3-ep8 balanced,skewed 3 1 270 --no-compile
