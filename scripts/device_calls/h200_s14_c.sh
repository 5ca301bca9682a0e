#!/usr/bin/env bash
# Session 14, call C (main; < 9.5 min): the fused FC1's backward without the zero-filled [M, I] (its GPU tests), the
# benchmark's host-ahead floor (its GPU test), then the layers on balanced routing with every peer in the same run:
# GPT-OSS (call B: 1.14 / 1.08 / 1.06 of its floor, eager / host-ahead / graph), Mixtral (session 13 call G: 1.04 /
# 1.02 / 0.99), Qwen3 (call A: 1.31 / 1.21 / 1.23).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
gpu_test_subset layer_tests 100 tests/kernels/test_moe_fused_gpu.py tests/unit/test_gpu.py -k \
  "fused or bench_moe_rows or sync_free"
for shape in gpt-oss-20b mixtral-8x7b qwen3-30b-a3b; do
  echo "== bench moe $shape"
  reps="--reps 5 --warmup 2"; [ $shape = mixtral-8x7b ] && reps="--reps 3 --warmup 1"
  timeout -k 10 200 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes $shape \
    --routing balanced $reps --json "$out/$shape.json" > "$out/$shape.log" 2>&1
  filter < "$out/$shape.log" | grep -E "^(gpt|mix|qwen)|Error" | grep -v per-expert | tail -12
done
