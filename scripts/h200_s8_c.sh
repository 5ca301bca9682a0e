#!/usr/bin/env bash
# Next session, call C (< 5 min): the weight gradient at DeepSeek-V3 (its weakest op: ~440 TF/s against ~580 for the
# forward) with the trial configs of 128 rows per reduction step, against torch._grouped_mm, both routings.
source scripts/device_common.sh "$@"
timeout -k 10 280 python3 -m moetrain bench gemm --shapes dsv3 --ops wgrad --routing balanced,skewed --budget 120 \
  --json "$out/bench_gemm_wgrad.json" 2>&1 | filter | tee "$out/bench_gemm_wgrad.log" | grep -E "TF/s|layer|^dsv3" | tail -20
