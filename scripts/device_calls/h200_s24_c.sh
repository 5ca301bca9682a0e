#!/usr/bin/env bash
# Session 24, call C (< 10 min): the six GEMMs of every other benchmark shape on both routings (call A had
# DeepSeek-V3's), every config, then torch, our best and auto in turns: auto against torch on every shape and op
# after the autotuner began timing torch._grouped_mm beside its candidates.
source scripts/device_common.sh "$@"
for shape in qwen3 dsv3-ep8 gptoss mixtral; do
  echo "== bench gemm, $shape"
  run_gemm_bench $shape balanced,skewed 150 140
done
