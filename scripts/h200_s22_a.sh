#!/usr/bin/env bash
# Session 22, call A (< 8 min): the weight gradient's tile pairs sharing dy (kernels/wgrad_pairs.py, new). GPU tests
# (bitwise the plain kernel on skewed and balanced routing, against torch at the expert shapes; a hang is a barrier
# bug, hence the timeout), then timed queued, in turns, against the plain ping-pong, the tuned pick and torch at
# DeepSeek-V3 and Qwen3 on balanced and the layer's skewed routing.
source scripts/device_common.sh "$@"
gpu_test_subset pairs 300 tests/kernels/test_wgrad_pingpong_gpu.py -k "pairs or expert_shapes or refused" || exit 1
timeout -k 10 300 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --routing balanced,layer-skewed \
  --queued --rounds 3 --variants 128x128/s4/g8,128x128/s4/g8/sorted,128x128/s4/g8/p4,128x128/s4/g8/p5,\
128x128/s4/g8/p6,128x128/s3/g8/p6,128x128/s4/g8/sorted/p6 2>&1 | filter
