#!/usr/bin/env bash
# Session 20, call H (< 7 min): the six GEMMs on the benchmark's skewed routing (Dirichlet shares over the experts),
# auto per op against torch, at DeepSeek-V3 and Qwen3 (calls D and F measured balanced routing).
source scripts/device_common.sh "$@"
for shape in dsv3 qwen3; do
  echo "== bench gemm, $shape, skewed"
  budget=90; [ "$shape" = qwen3 ] && budget=50
  run_gemm_bench $shape skewed $budget 200
done
