#!/usr/bin/env bash
# Session 10, call B (< 8 min), branch next/wgrad-pingpong: call A's ping-pong weight gradient was 1.15x our Triton
# kernel at DeepSeek-V3 balanced but 0.75x skewed and 0.83x at EP8's FC1 (long reductions). Here: L2 bands (g8;
# g1 = call A's row-major order), a fifth stage, and 64x256 consumer tiles (m64n256 wgmma); GPU tests, timing,
# then one launch of each under Nsight Compute on skewed DeepSeek-V3 FC1 rows (64 experts) and EP8 FC1 (8 experts).
source scripts/device_common.sh "$@"
V=128x128/s4/g1,128x128/s4/g8,128x128/s5/g8,64x256/s4/g8,64x256/s3/g8
echo "== ping-pong GPU tests"
timeout -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_wgrad_pingpong_gpu.py \
  > "$out/pingpong_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error|Timeout" "$out/pingpong_tests.log" | tail -8
grep -q "failed" "$out/pingpong_tests.log" && exit 1
echo "== timing"
timeout -k 10 300 python3 scripts/wgrad_pingpong_bench.py --variants $V > "$out/bench.log" 2>&1
filter < "$out/bench.log" | tail -16
ncu_profile skew_dsv3 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3 --layers fc1 --routing skewed \
  --groups 64 --profile --variants 128x128/s4/g1,128x128/s4/g8,64x256/s4/g8
ncu_profile ep8_fc1 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3-ep8 --layers fc1 --routing balanced \
  --groups 8 --profile --variants 128x128/s4/g8,64x256/s4/g8
