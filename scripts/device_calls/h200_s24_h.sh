#!/usr/bin/env bash
# Session 24, call H (< 4 min): can one producer warp feed a GEMM's A operand by TMA one row per copy (a row gather
# inside the GEMM, which would remove Qwen3's permuted row copies)? scripts/tma_gather_probe.py: whole boxes against
# row-by-row copies of random token rows, loads alone and under a 128x128 wgmma consumer; 4 and 6 stages.
source scripts/device_common.sh "$@"
for stages in 4 6; do
  echo "== stages $stages"
  timeout -k 10 100 python3 scripts/tma_gather_probe.py --stages $stages --reps 7 2>&1 | filter
done
