#!/usr/bin/env bash
# Validation of branch next/skew-tuning (< 8 min): the grouped GEMM autotuner judging each candidate on the caller's
# routing plus a skewed one of the same rows. GPU tests of the grouped GEMM, then the layers bench moe timed in
# session 13 (call C), every peer in the same run: compare ours' ratios on balanced and skewed routing with call C's
# (DeepSeek-V3 balanced 0.92 of its floor eager, skewed +30.0%; Qwen3 1.35 eager / 1.24 graphed, skewed +17.3%).
# Merge only if skew improves and balanced does not regress.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== GPU tests (grouped GEMM)"
gpu_test_subset tests 100 tests/kernels/test_grouped_gemm_gpu.py || exit 1
for shape in deepseek-v3 qwen3-30b-a3b; do
  echo "== bench moe $shape"
  timeout -k 10 160 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes $shape --reps 5 \
    --warmup 2 --json "$out/$shape.json" > "$out/$shape.log" 2>&1
  filter < "$out/$shape.log" | grep -E "^(deep|qwen)|Error|tuned" | grep -v per-expert | tail -24
done
