#!/usr/bin/env bash
# Session 13, call E: call D's A/B (FC1 + SwiGLU separate vs fused, the whole layer in turns) at GPT-OSS and Mixtral.
source scripts/device_common.sh "$@"
for spec in "gpt-oss-20b 130" "mixtral-8x7b 230"; do
  set -- $spec
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 "$2" python3 scripts/layer_fc1_swiglu_ab.py \
    --shapes "$1" --reps 7 > "$out/ab_$1.log" 2>&1
  filter < "$out/ab_$1.log" | tail -9
done
