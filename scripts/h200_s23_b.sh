#!/usr/bin/env bash
# Session 23, call B (< 8 min): the weight gradient's trimmed tail steps (wgrad_pingpong.py TRIM: a group's last
# partial step multiplies only its rows, rounded up to 16 or 32; an empty group's none). GPU tests of the kernel file,
# then the plain and trimmed variants against torch and the autotuner's pick, queued, in turns.
source scripts/device_common.sh "$@"
gpu_test_subset wgrad_pingpong 400 tests/kernels/test_wgrad_pingpong_gpu.py || exit 1
timeout -k 10 420 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --routing balanced,layer-skewed,skewed \
  --queued --rounds 3 --variants 128x128/s4/g8,128x128/s4/g8/trim,128x128/s4/g8/sorted,128x128/s4/g8/sorted/trim,128x128/s4/g1/sorted,128x128/s4/g1/sorted/trim 2>&1 | filter
