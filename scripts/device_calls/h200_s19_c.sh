#!/usr/bin/env bash
# Session 19, call C (< 9 min): the rest of the layer table on main as session 18 left it (Mixtral both routings;
# DeepSeek-V3 skewed with its graphed row, which session 18 did not time with "sorted"), and where the host's time
# goes before GPT-OSS's first expert GEMM (its eager layer is 1.09x the floor against 1.01 host-ahead, call B).
source scripts/device_common.sh "$@"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "== host time, GPT-OSS"
timeout -k 10 100 python3 scripts/host_breakdown.py --shapes gpt-oss-20b --calls 20 2>&1 | filter \
  | tee "$out/host_gptoss.log" | head -40
echo "== Mixtral layer"
run_bench mixtral-8x7b balanced,skewed 3 1 220
echo "== DeepSeek-V3 layer, skewed"
run_bench deepseek-v3 skewed 3 1 200 --no-compile
grep -E "tuned (wgrad|fwd|dgrad)" "$out/deepseek-v3.log" | head -12
