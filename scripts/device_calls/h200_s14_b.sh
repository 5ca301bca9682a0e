#!/usr/bin/env bash
# Session 14, call B (branch s14/trial; < 9.5 min): the skew-aware autotuner at DeepSeek-V3 (session 13 call C:
# 0.92 of its floor, skewed +30%) and GPT-OSS (call G: 1.14 / 1.05 / 1.05 of its floor, eager / host-ahead / graph),
# GPT-OSS's kernels (what is left besides its GEMMs), and Mixtral's eager timeline (its idle gaps: call G had eager
# 56.13 ms against 53.86 graphed).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for shape in deepseek-v3 gpt-oss-20b; do
  echo "== bench moe $shape"
  extra=""; [ $shape = gpt-oss-20b ] && extra="--profile"
  timeout -k 10 185 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes $shape --reps 5 \
    --warmup 2 $extra --json "$out/$shape.json" > "$out/$shape.log" 2>&1
  filter < "$out/$shape.log" | grep -E "^(deep|gpt)|Error|over balanced" | grep -v per-expert | tail -22
done
filter < "$out/gpt-oss-20b.log" | grep -A16 "balanced\] ours (auto): " | head -17
echo "== profile mixtral-8x7b balanced (auto)"
timeout -k 10 150 python3 -m moetrain bench moe --backends auto --no-compile --profile --shapes mixtral-8x7b \
  --routing balanced --reps 3 --warmup 1 > "$out/mixtral_profile.log" 2>&1
filter < "$out/mixtral_profile.log" | grep -E -A17 "ours \(auto\): |^mixtral" | head -30
