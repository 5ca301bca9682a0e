#!/usr/bin/env bash
# Session 18, call D (< 4 min): the schedules timed as a layer runs them, calls queued back to back (call C timed
# each call from an idle GPU, so interleave's and mix's schedule-building torch ops, ~0.3-0.5 ms of host launches,
# counted against them: on balanced routing, where interleave deals the plain tiles, it lost 0.35-0.53 ms).
source scripts/device_common.sh "$@"
echo "== weight gradient schedules, queued"
timeout -k 10 300 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --rounds 3 --queued \
  --routing balanced,layer-skewed \
  --variants 128x128/s4/g8,128x128/s4/g1,128x128/s4/g8/mix,128x128/s4/g8/il64,128x128/s4/g8/il128,128x128/s4/g1/il64,128x128/s4/g1/il128 \
  2>&1 | filter | tail -14
