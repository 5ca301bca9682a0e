#!/usr/bin/env bash
# Session 20, call E (< 6 min): the DeepSeek-V3 and GPT-OSS layers with the autotuner and auto timing candidates queued
# (call D: Qwen3's layer level with call A's within the machines' spread; DeepSeek-V3's FC1 forward and data
# gradient now auto 1.03-1.04x torch).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== deepseek-v3"
run_bench deepseek-v3 balanced,skewed 3 1 220 --no-compile
grep -E "tuned (wgrad|fwd|dgrad)" "$out/deepseek-v3.log" | head -12
echo "== gpt-oss-20b"
run_bench gpt-oss-20b balanced 9 2 150 --no-compile
grep -E "tuned (wgrad|fwd|dgrad)" "$out/gpt-oss-20b.log" | head -12
