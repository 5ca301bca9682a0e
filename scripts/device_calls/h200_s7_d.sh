#!/usr/bin/env bash
# Session 7, call D (< 8 min): every GPU test after this session's kernel changes (routing kernel, combine
# backward, autotuner finalists); our FC1 data gradient on the layer's own operands vs random ones
# (scripts/gemm_in_context.py); Qwen3's layer, both routings, eager and graphed, against every peer.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 200
echo "== FC1 dgrad in context"
timeout -k 10 90 python3 scripts/gemm_in_context.py --shape qwen3-30b-a3b 2>&1 | filter | tail -32
echo "== bench moe qwen3"
timeout -k 10 230 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced,skewed --reps 5 --warmup 2 \
  --backends triton,auto --graphs --json "$out/moe_qwen3.json" 2>&1 | filter | grep -v "^    \[" | tail -40
