#!/usr/bin/env bash
# Session 15, call A (main; < 9 min): where the host's time goes in our eager layer (cProfile of the real path on the
# GPU host: forward and backward issue times, own-time and cumulative rankings) at Qwen3 and GPT-OSS; then Qwen3's
# layer with the SwiGLU tile of session 14 (call G: backward 1.14x alone), both routings, every peer in the run.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== host profile"
timeout -k 10 170 python3 scripts/host_profile_moe.py --shapes qwen3-30b-a3b,gpt-oss-20b --calls 10 --top 30 \
  > "$out/host_profile.log" 2>&1
grep -E "^== " "$out/host_profile.log"
echo "== bench moe qwen3-30b-a3b"
timeout -k 10 280 python3 -m moetrain bench moe --backends auto --graphs --host-ahead --shapes qwen3-30b-a3b \
  --routing balanced,skewed --reps 5 --warmup 2 --json "$out/qwen3.json" > "$out/qwen3.log" 2>&1
filter < "$out/qwen3.log" | grep -E "^qwen|Error" | grep -v per-expert | tail -24
