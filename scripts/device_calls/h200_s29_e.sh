#!/usr/bin/env bash
# Session 29, call E (< 5 min): where Mixtral's eager call loses ~2 ms to its host-ahead one (call B: 54.80 against
# 52.85 ms, 15 repetitions) when its host needs ~1.2 ms before FC1: eager_gaps.py's GPU idle per segment, with Qwen3's
# beside it (session 28 A: 1.6 ms of host before FC1, 2.2 ms start-to-end excess).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(cd scripts && timeout -k 10 280 python3 eager_gaps.py --shapes mixtral-8x7b,qwen3-30b-a3b --calls 7 2>&1 | filter \
  | tee "$out/eager_gaps.txt" | head -80)
