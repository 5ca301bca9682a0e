#!/usr/bin/env bash
# Session 25, call A (< 6 min): is it the issuing thread or the TMA unit that limits one-row TMA copies (session 24
# H: ~15 ns per copy from one warp, each copy waiting on its row index's load)? scripts/tma_gather_probe.py, every
# way: the whole box; rows from one warp with the index loaded before each copy or eight at a time; from two and
# four warps; loads alone and under a 128x128 wgmma consumer; 4 and 6 stages.
source scripts/device_common.sh "$@"
for stages in 4 6; do
  echo "== stages $stages"
  timeout -k 10 200 python3 scripts/tma_gather_probe.py --stages $stages --reps 7 2>&1 | filter
done
