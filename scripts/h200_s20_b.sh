#!/usr/bin/env bash
# Session 20, call B (< 7 min): "sorted" (groups heaviest first, programs in step) in the forward / data gradient:
# the ping-pong's GPU tests (bit for bit the plain schedule's tiles, graph replays) and the trial configs' test, then
# the Triton and ping-pong kernels with and without it, queued, on both of the layers' routings at DeepSeek-V3 and
# Qwen3 (the weight gradient's sorted configs were 2-15% faster on skewed routing in session 19).
source scripts/device_common.sh "$@"
echo "== tests"
gpu_test_subset sorted 150 tests/kernels/test_rowgroup_pingpong_gpu.py tests/kernels/test_grouped_gemm_gpu.py \
  -k "sorted or cuda_graph or trial" || exit 1
echo "== forward / data gradient, sorted"
timeout -k 10 300 python3 scripts/rowgroup_pingpong_bench.py --shapes dsv3,qwen3 --rounds 3 --queued \
  --routing balanced,layer-skewed \
  --variants pingpong/128x128x64/s5/g8,pingpong/128x128x64/s5/g8/sorted,128x256x64/s3/w8/tma/split,128x256x64/s3/w8/tma/split/sorted,128x256x64/s3/w8/tma,128x256x64/s3/w8/tma/sorted \
  2>&1 | filter | tee "$out/rowgroup.log"
