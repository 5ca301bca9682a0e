#!/usr/bin/env bash
# Session 25, call C (< 5 min): B's gathered forward was 1.35-1.9x the copy + box at 128x128 tiles (~8-9 clocks per
# row copy per SM: the TMA unit's rate for single-row boxes). 64x256 consumer tiles need half the row copies per
# MMA step: scripts/fc1_gather_bench.py with both tiles, plain and fused FC1; the gathered tests again (B's 64x256
# case asked for 5 stages, which do not fit).
source scripts/device_common.sh "$@"
gpu_test_subset rowgroup 200 tests/kernels/test_rowgroup_pingpong_gpu.py -k "gather"
echo "== fc1 gather bench"
timeout -k 10 300 python3 scripts/fc1_gather_bench.py --shapes qwen3-30b-a3b,gpt-oss-20b,deepseek-v3 \
  --reps 5 2>&1 | filter
