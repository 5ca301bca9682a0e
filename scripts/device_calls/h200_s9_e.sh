#!/usr/bin/env bash
# Session 9, call E (< 9 min): the host-ahead rows with dense GEMMs as the lead-in instead of a sleep (call D timed
# Mixtral host-ahead 6% under its own six GEMMs: clocks recovering from the power cap during the sleep?), at Mixtral
# and DeepSeek-V3; then the six grouped GEMMs of a layer, ours against torch, at DeepSeek-V3 and Qwen3 (the 1.1x claim).
source scripts/device_common.sh "$@"
echo "== bench rows test"
timeout -k 10 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/unit/test_gpu.py -k "bench_moe_rows" \
  > "$out/gpu_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -4
echo "== layers"
timeout -k 10 100 python3 -m moetrain bench moe --shapes mixtral-8x7b --routing balanced --reps 3 --warmup 1 \
  --backends auto --graphs --host-ahead --no-compile --json "$out/moe_mixtral.json" > "$out/moe_mixtral.log" 2>&1
filter < "$out/moe_mixtral.log" | grep -E "^mixt|Error" | tail -10
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 150 python3 -m moetrain bench moe --shapes deepseek-v3 \
  --routing balanced --reps 5 --warmup 2 --backends auto --graphs --host-ahead --json "$out/moe_dsv3.json" \
  > "$out/moe_dsv3.log" 2>&1
filter < "$out/moe_dsv3.log" | grep -E "^deep|Error" | tail -12
echo "== six GEMMs"
timeout -k 10 230 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --routing balanced --budget 200 \
  --json "$out/bench_gemm.json" > "$out/bench_gemm.log" 2>&1
filter < "$out/bench_gemm.log" | grep -vE "^\s+[0-9]+x|^\[" | tail -24
