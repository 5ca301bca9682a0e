#!/usr/bin/env bash
# Next session, call A (< 9 min): all GPU tests (the optimizer's fused-AdamW helper was factored out after session
# 6's last GPU run); then where the MoE layer's time goes besides its GEMMs, with the fixed timeline (session 6's was
# contaminated by torch mirroring our call range onto the GPU): Qwen3 (1.45x the six GEMMs) and Mixtral (1.17x).
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 200
for shape in qwen3-30b-a3b mixtral-8x7b; do
  echo "== $shape: kernels and timeline of ours vs the eager reference"
  timeout -k 10 140 python3 -m moetrain bench moe --shapes $shape --routing balanced --reps 3 --warmup 1 \
    --backends auto --no-compile --profile 2>&1 | filter | grep -v "^    \[" | cut -c1-300 | tail -45
done
