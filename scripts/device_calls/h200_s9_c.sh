#!/usr/bin/env bash
# Session 9, call C (< 9.5 min): the peak-memory fix of bench moe (every contender's baseline holds one set of
# gradients) and FC1's data-gradient rows freed before its weight gradient: the fused layer's GPU tests and the bench
# test, then DeepSeek-V3 (balanced) and Qwen3 (both routings) with every peer, graphs and the host-ahead rows.
source scripts/device_common.sh "$@"
echo "== GPU tests"
timeout -k 10 170 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_moe_fused_gpu.py \
  tests/unit/test_gpu.py -k "not compiled and not tiny_trains" > "$out/gpu_tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -6
echo "== layers"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 210 python3 -m moetrain bench moe --shapes deepseek-v3 \
  --routing balanced --reps 5 --warmup 2 --backends auto --graphs --host-ahead --json "$out/moe_dsv3.json" \
  > "$out/moe_dsv3.log" 2>&1
filter < "$out/moe_dsv3.log" | grep -E "^deep|Error" | tail -12
timeout -k 10 150 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced,skewed --reps 5 --warmup 2 \
  --backends auto --graphs --host-ahead --json "$out/moe_qwen3.json" > "$out/moe_qwen3.log" 2>&1
filter < "$out/moe_qwen3.log" | grep -E "^qwen|Error" | tail -22
