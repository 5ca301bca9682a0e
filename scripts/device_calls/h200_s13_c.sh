#!/usr/bin/env bash
# Session 13, call C: the layers with auto choosing between FC1 + SwiGLU separate and fused (Qwen3 balanced and
# skewed, DeepSeek-V3 balanced and skewed), every contender in turns in one process per shape.
source scripts/device_common.sh "$@"
for spec in "qwen3-30b-a3b balanced,skewed 5 2 180" "deepseek-v3 balanced,skewed 5 2 370"; do
  set -- $spec
  echo "== $1"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 "$5" python3 -m moetrain bench moe --backends auto \
    --graphs --host-ahead --shapes "$1" --routing "$2" --reps "$3" --warmup "$4" > "$out/$1.log" 2>&1
  filter < "$out/$1.log" | grep -E "^(qwen3|deepseek)|moe_fc1|skewed over" | grep -v "per-expert" | tail -26
done
