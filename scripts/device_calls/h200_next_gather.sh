#!/usr/bin/env bash
# Next session (< 5 min): the ping-pong weight gradient with x's rows gathered by a fourth warpgroup (cp.async), written
# after session 10's device time was spent. GPU tests first (a hang is a barrier bug: the timeout), then FC1's
# weight gradient at DeepSeek-V3, Qwen3 and EP8: the gathered ping-pong against the permuted copy + {torch, our
# Triton kernel, the ping-pong} and our gathered Triton kernel, every contender timed with what it needs.
source scripts/device_common.sh "$@"
echo "== GPU tests"
timeout -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_wgrad_pingpong_gpu.py \
  tests/kernels/test_grouped_gemm_gpu.py -k "pingpong or gathered or trial" > "$out/gather_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error|Timeout" "$out/gather_tests.log" | tail -8
grep -q "failed\|Timeout" "$out/gather_tests.log" && exit 1
echo "== timing"
timeout -k 10 200 python3 scripts/wgrad_pingpong_bench.py --gather --shapes dsv3,qwen3,dsv3-ep8 \
  --variants 128x128/s3/g8,128x128/s4/g8 > "$out/gather_bench.log" 2>&1
filter < "$out/gather_bench.log" | tail -10
echo "== queued_ms GPU test (new in session 10)"
timeout -k 10 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/unit/test_gpu.py -k queued 2>&1 | tail -3
