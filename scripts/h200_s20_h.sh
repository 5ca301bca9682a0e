#!/usr/bin/env bash
# Session 20, call H (< 7 min): the six GEMMs on the benchmark's skewed routing (Dirichlet shares over the experts),
# auto per op against torch, at DeepSeek-V3 and Qwen3 (calls D and F measured balanced routing).
source scripts/device_common.sh "$@"
for shape in dsv3 qwen3; do
  echo "== bench gemm, $shape, skewed"
  budget=90; [ "$shape" = qwen3 ] && budget=50
  timeout -k 10 200 python3 -m moetrain bench gemm --shapes $shape --routing skewed --budget $budget \
    > "$out/gemm_$shape.log" 2>&1
  echo "rc $?"; filter < "$out/gemm_$shape.log" | grep -E "^$shape|^layer|auto picked" | tail -14
done
