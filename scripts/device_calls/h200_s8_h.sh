#!/usr/bin/env bash
# Session 8, call H (< 8 min): the sort change (searchsorted offsets) and the sync-free check of every backend's
# layer on the GPU; where the host's time goes before each GPU gap of one eager call (scripts/gap_sources.py) at
# Qwen3 and DeepSeek-V3; Qwen3's layer again, eager and graphed, against the eager reference and the floor.
source scripts/device_common.sh "$@"
echo "== GPU tests (MoE layer, every backend)"
timeout -k 10 170 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_moe_fused_gpu.py \
  tests/unit/test_gpu.py -k "not compiled and not tiny_trains" 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== gap sources"
timeout -k 10 170 python3 scripts/gap_sources.py --shapes qwen3-30b-a3b,deepseek-v3 --first 45 2>&1 | filter \
  | tee "$out/gap_sources.log" | head -170
echo "== qwen3 layer"
timeout -k 10 170 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced,skewed --reps 5 --warmup 2 \
  --backends triton,auto --graphs --no-compile --json "$out/moe_qwen3.json" 2>&1 | filter | grep -E "^qwen3|Error" | tail -20
