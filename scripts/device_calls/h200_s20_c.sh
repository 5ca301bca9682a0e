#!/usr/bin/env bash
# Session 20, call C (< 6 min): what makes the autotuner take the tail-split Triton config where, timed queued on the
# layers' routings, it is the slowest of the forward / data gradient candidates (call B: split 0-9% behind the same
# config without the split, the ping-pong 13% ahead at Qwen3's FC2 data gradient). The same candidates timed two
# ways, each call from an idle GPU (as the autotuner times) and queued (as the layer runs them), on balanced, the
# autotuner's skewed (Dirichlet over groups) and the layer's skewed routing.
source scripts/device_common.sh "$@"
variants=pingpong/128x128x64/s4/g8,pingpong/128x128x64/s5/g8,128x256x64/s3/w8/tma/split,128x256x64/s3/w8/tma
for mode in idle queued; do
  echo "== $mode"
  flag=""; [ "$mode" = queued ] && flag=--queued
  timeout -k 10 200 python3 scripts/rowgroup_pingpong_bench.py --shapes qwen3,dsv3 --rounds 3 $flag \
    --routing balanced,skewed,layer-skewed --variants "$variants" 2>&1 | filter | tee "$out/rowgroup_$mode.log"
done
