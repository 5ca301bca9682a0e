#!/usr/bin/env bash
# Session 11, last call (< 3 min): the ping-pong weight gradient with its programs in cohorts (wgrad_pingpong._tile),
# written after the layers showed skew costing DeepSeek-V3 +30%. GPU tests first (bitwise equal to one cohort, exact
# against float64), then DeepSeek-V3 and Qwen3 weight gradients, balanced and skewed, 1 / 2 / 4 cohorts in turns.
source scripts/device_common.sh "$@"
echo "== GPU tests"
timeout -k 10 70 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_wgrad_pingpong_gpu.py \
  -k cohorts > "$out/cohort_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error|Timeout" "$out/cohort_tests.log" | tail -6
grep -q "failed\|Timeout" "$out/cohort_tests.log" && exit 1
echo "== timing"
timeout -k 10 110 python3 scripts/wgrad_pingpong_bench.py --shapes dsv3,qwen3 --rounds 3 \
  --variants 128x128/s4/g8,128x128/s4/g8/c2,128x128/s4/g8/c4 > "$out/cohort_bench.log" 2>&1
filter < "$out/cohort_bench.log" | tail -10
