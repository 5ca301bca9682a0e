#!/usr/bin/env bash
# Session 10, call A (< 8 min), branch next/wgrad-pingpong rebased on main: the ping-pong weight gradient's GPU tests
# (a hang is a barrier-phase bug: hence the timeout), its timing against our Triton weight gradient and torch, one
# launch of each under Nsight Compute at DeepSeek-V3's FC1 (64 experts of 256 rows); and the bench's host-ahead test
# (the lead-in's calibration changed after the last device call of session 9).
source scripts/device_common.sh "$@"
echo "== ping-pong GPU tests"
timeout -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_wgrad_pingpong_gpu.py \
  > "$out/pingpong_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error|Timeout" "$out/pingpong_tests.log" | tail -6
echo "== bench moe GPU test"
timeout -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/unit/test_gpu.py -k bench_moe_rows \
  > "$out/bench_moe_test.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$out/bench_moe_test.log" | tail -4
if grep -q " passed" "$out/pingpong_tests.log" && ! grep -q "failed" "$out/pingpong_tests.log"; then
  echo "== timing"
  timeout -k 10 200 python3 scripts/wgrad_pingpong_bench.py > "$out/bench.log" 2>&1
  filter < "$out/bench.log" | tail -16
  ncu_profile pingpong_dsv3 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3 --layers fc1 --routing balanced \
    --groups 64 --profile
fi
