#!/usr/bin/env bash
# Session 13, call D: the layer with FC1 + SwiGLU forced separate vs fused, in turns, one process per shape.
source scripts/device_common.sh "$@"
for spec in "qwen3-30b-a3b 100" "gpt-oss-20b 130" "mixtral-8x7b 230"; do
  set -- $spec
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 "$2" python3 scripts/layer_fc1_swiglu_ab.py \
    --shapes "$1" --reps 7 > "$out/ab_$1.log" 2>&1
  filter < "$out/ab_$1.log" | tail -9
done
# (The first run, call D, stopped at GPT-OSS: the key filter took every shape's choice from the cache file. Call E
# re-ran GPT-OSS and Mixtral after the fix: `bash scripts/device_calls/h200_s13_e.sh`.)
