#!/usr/bin/env bash
# Session 7, call C (< 6 min): the routing kernel with many tokens per program and the 2-D combine backward
# (GPU tests), where the host's time goes in our layer (scripts/host_profile_moe.py), and Qwen3's layer
# with and without CUDA graphs after those two kernels changed.
source scripts/device_common.sh "$@"
echo "== GPU tests: routing and row kernels (these modules run on CUDA when present; not marked gpu)"
timeout -k 10 150 python3 -m pytest -q tests/kernels/test_route.py tests/kernels/test_moe_rows.py \
  tests/kernels/test_moe_fused_gpu.py -p no:cacheprovider -rf 2>&1 | tail -4
echo "== host profile, qwen3-30b-a3b"
timeout -k 10 150 python3 scripts/host_profile_moe.py --shape qwen3-30b-a3b --calls 20 --top 30 2>&1 | filter | tail -75
echo "== bench moe qwen3 with graphs"
timeout -k 10 150 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced --reps 5 --warmup 2 \
  --backends auto --no-compile --graphs 2>&1 | filter | grep -v "^    \[" | tail -12
