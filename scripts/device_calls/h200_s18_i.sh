#!/usr/bin/env bash
# Session 18, call I (< 3 min): call H found DeepSeek-V3's skewed weight gradient 5-7% faster as two launches, heavy
# groups then light ones (9.59 -> 8.91 ms at FC1, 4.89 -> 4.69 at FC2), than as one in expert order. In one launch:
# the mix schedule's group order (heaviest first) with every program in step ("sorted"), queued.
source scripts/device_common.sh "$@"
echo "== sorted group order, queued"
timeout -k 10 200 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --rounds 3 --queued \
  --routing balanced,layer-skewed \
  --variants 128x128/s4/g8,128x128/s4/g8/sorted,128x128/s4/g8/mix,128x128/s4/g1,128x128/s4/g1/sorted 2>&1 \
  | filter | tail -14
