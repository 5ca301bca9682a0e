#!/usr/bin/env bash
# Session 25, call D (< 8 min): C's gathered forward was still 1.08-1.29x the copy + box at 64x256 tiles: TMA row
# copies deliver ~27 GB/s per SM, a 64x256 consumer needs ~29. Hybrid loaders: one or two of the four loader warps
# copy their rows by cp.async (the load path) while the others use TMA. The gathered GPU tests (cp.async cases
# included), then scripts/fc1_gather_bench.py.
source scripts/device_common.sh "$@"
gpu_test_subset rowgroup 240 tests/kernels/test_rowgroup_pingpong_gpu.py -k "gather"
echo "== fc1 gather bench"
timeout -k 10 240 python3 scripts/fc1_gather_bench.py --shapes qwen3-30b-a3b,gpt-oss-20b --reps 5 2>&1 | filter
timeout -k 10 120 python3 scripts/fc1_gather_bench.py --shapes deepseek-v3 --routing balanced --reps 5 2>&1 | filter \
  | tail -2
