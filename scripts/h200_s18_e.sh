#!/usr/bin/env bash
# Session 18, call E (< 4 min): the ping-pong weight gradient with each consumer reading its next tile's group and rows
# before its turn ("pf"). Calls B-D: the interleave schedule, which dealt the plain tiles on balanced routing but with
# more per-tile arithmetic and loads, lost 6-16% there: the bookkeeping between the other warpgroup's turn and ours is
# on the tensor cores' critical path. GPU tests, then pf against the plain kernel, calls queued.
source scripts/device_common.sh "$@"
echo "== wgrad ping-pong GPU tests (prefetch and the plain ones)"
gpu_test_subset wgrad_pp 150 tests/kernels/test_wgrad_pingpong_gpu.py -k "prefetch or float64 or torch"
echo "== prefetch, queued"
timeout -k 10 300 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3,gptoss --rounds 3 --queued \
  --routing balanced,layer-skewed \
  --variants 128x128/s4/g8,128x128/s4/g8/pf,128x128/s5/g8,128x128/s5/g8/pf,128x128/s4/g1,128x128/s4/g1/pf \
  2>&1 | filter | tail -16
