#!/usr/bin/env bash
# Session 19, call J (< 3 min): "sorted" with the weight gradient's other ping-pong candidates (5 stages; bands of one
# row tile), against the same configs plain, queued, on both routings: whether they join the autotuner's candidates
# (call I: at Qwen3 the tuner took s5/g8 plain over s4/g8/sorted).
source scripts/device_common.sh "$@"
timeout -k 10 150 python3 scripts/wgrad_pingpong_bench.py --shapes qwen3,dsv3 --rounds 3 --queued \
  --routing balanced,layer-skewed \
  --variants 128x128/s5/g8,128x128/s5/g8/sorted,128x128/s4/g1,128x128/s4/g1/sorted \
  2>&1 | filter | tee "$out/wgrad.log"
