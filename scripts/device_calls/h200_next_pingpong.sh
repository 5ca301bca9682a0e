#!/usr/bin/env bash
# Next session, first call on branch next/wgrad-pingpong (< 6 min): the ping-pong weight gradient's GPU tests (a hang
# is a barrier-phase bug: hence the timeout), then its timing against our Triton weight gradient and torch.
source scripts/device_common.sh "$@"
echo "== GPU tests"
timeout -k 10 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_wgrad_pingpong_gpu.py \
  > "$out/gpu_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error|Timeout" "$out/gpu_tests.log" | tail -6
echo "== timing"
timeout -k 10 200 python3 scripts/wgrad_pingpong_bench.py > "$out/bench.log" 2>&1
filter < "$out/bench.log" | tail -16
