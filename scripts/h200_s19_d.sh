#!/usr/bin/env bash
# Session 19, call D (< 5 min): the ping-pong weight gradient with the producer finding each next tile early (PREFETCH:
# after issuing the tile's first step, while the ring is full, instead of after its last). Hypothesis (bench/NOTES.md
# "Next" after session 18): per-tile schedule logic costs 4-16% because the single producer warp computes the next
# tile's coordinates (dependent loads) between tiles while the 4-stage ring drains. GPU tests, then plain / sorted,
# each with and without, queued, on DeepSeek-V3 and Qwen3 both routings.
source scripts/device_common.sh "$@"
echo "== GPU tests (producer prefetch)"
gpu_test_subset prefetch 120 tests/kernels/test_wgrad_pingpong_gpu.py -k "prefetch or sorted or matches_float64"
echo "== weight gradients"
timeout -k 10 240 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --rounds 3 --queued \
  --routing balanced,layer-skewed \
  --variants 128x128/s4/g8,128x128/s4/g8/pf,128x128/s4/g8/sorted,128x128/s4/g8/sorted/pf,128x128/s5/g8,128x128/s5/g8/pf \
  2>&1 | filter | tee "$out/wgrad.log" | grep -v "^  tuned"
