#!/usr/bin/env bash
# Session 18, call C (< 5 min): interleave rewritten (call B: it lost 10-35% even on balanced routing, where it deals
# the plain schedule's tiles: its per-tile index arithmetic, int64 divisions and a group-then-rows chain of dependent
# loads in every partition). Now int32, and the slot's group and rows read side by side. Its GPU tests, then it
# against the plain schedule on balanced and the layers' skewed routing, and the autotuner's picks.
source scripts/device_common.sh "$@"
echo "== wgrad ping-pong GPU tests (interleave)"
gpu_test_subset wgrad_pp 150 tests/kernels/test_wgrad_pingpong_gpu.py -k "interleave or refused"
echo "== weight gradient schedules"
timeout -k 10 240 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --rounds 3 \
  --routing balanced,layer-skewed \
  --variants 128x128/s4/g8,128x128/s4/g8/il64,128x128/s4/g8/il128,128x128/s4/g8/il192 2>&1 | filter | tail -14
