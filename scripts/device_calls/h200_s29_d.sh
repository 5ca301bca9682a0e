#!/usr/bin/env bash
# Session 29, call D (< 6 min, warm after C): is DeepSeek-V3's skew penalty the skew or the tiles? Balanced routing at
# 8320 tokens (66560 rows: 260 per expert, two 128-row tiles and a 64-row tail of 4 rows) beside the usual 8192 (256
# per expert: two full tiles), every peer but the compiled reference; compare the time per token.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for tokens in 8192 8320; do
  timeout -k 10 170 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes deepseek-v3 \
    --routing balanced --reps 3 --warmup 1 --no-compile --tokens $tokens --json "$out/dsv3_$tokens.json" \
    > "$out/dsv3_$tokens.log" 2>&1
  echo "tokens $tokens rc $?"
  filter < "$out/dsv3_$tokens.log" | grep -E "^deep.*(ours \(auto\)|six torch GEMMs|reference eager)" | grep -v per-expert
done
