#!/usr/bin/env bash
# Session 19, call A (< 8 min): half tails in the ping-pong forward / data gradient (rowgroup_pingpong.py HALF TAILS: a
# group's last tile with <= 64 rows left runs 64-row MMAs; DeepSeek-V3's skewed routing pads 26% of the rows with
# 128-row tiles, 13% with 64). Its GPU tests, then the kernels against torch and the plain ping-pong on both routings,
# then FC1 with SwiGLU fused, with and without half tails.
source scripts/device_common.sh "$@"
echo "== GPU tests (rowgroup ping-pong)"
gpu_test_subset rowgroup 170 tests/kernels/test_rowgroup_pingpong_gpu.py
echo "== forward / data gradient"
timeout -k 10 230 python3 scripts/rowgroup_pingpong_bench.py --shapes dsv3,qwen3 --routing balanced,skewed --rounds 3 \
  --variants 128x128/s4/g8,128x128/s5/g8,128x128/s4/g8/split,128x128/s5/g8/split 2>&1 | filter | tee "$out/rowgroup.log"
echo "== FC1 + SwiGLU"
timeout -k 10 90 python3 scripts/fc1_swiglu_bench.py --shapes dsv3,qwen3 --routing balanced,skewed --rounds 3 \
  --stages 5,4 --split 2>&1 | filter | tee "$out/fc1_swiglu.log"
