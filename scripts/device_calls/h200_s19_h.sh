#!/usr/bin/env bash
# Session 19, call H (< 3 min): the sorted schedule by one Triton launch (schedule.py) on the GPU: its test against
# the PyTorch reference and the sorted weight gradient's GPU tests, then scripts/sorted_schedule_cost.py (call G,
# before it: sorted 1.34 ms at Qwen3's FC1 balanced, 1.26 with the schedule made once, 1.27 plain).
source scripts/device_common.sh "$@"
echo "== tests"
timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_grouped_gemm.py -k "skew_schedule" 2>&1 \
  | tail -2
gpu_test_subset sorted 100 tests/kernels/test_wgrad_pingpong_gpu.py tests/kernels/test_grouped_gemm_gpu.py \
  -k "sorted or mix or pingpong_wgrad_in_a_cuda_graph" || exit 1
echo "== sorted's cost"
timeout -k 10 150 python3 scripts/sorted_schedule_cost.py 2>&1 | filter
