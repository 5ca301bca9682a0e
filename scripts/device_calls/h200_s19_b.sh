#!/usr/bin/env bash
# Session 19, call B (< 7 min): the layers at Qwen3 and GPT-OSS on main as session 18 left it, with the weight
# gradient's "sorted" schedule among the autotuner's candidates (session 18 measured it in DeepSeek-V3's layer only;
# at Qwen3 it cost 8-11% of the weight gradients on balanced routing when forced), and which configs the tuner took.
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== Qwen3 layer, balanced and skewed"
run_bench qwen3-30b-a3b balanced,skewed 5 2 240
grep -E "tuned (wgrad|fwd|dgrad)" "$out/qwen3-30b-a3b.log" | head -12
echo "== GPT-OSS layer"
run_bench gpt-oss-20b balanced 9 2 150 --no-compile
grep -E "tuned (wgrad|fwd|dgrad)" "$out/gpt-oss-20b.log" | head -12
