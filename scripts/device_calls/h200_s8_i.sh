#!/usr/bin/env bash
# Session 8, call I (< 9.5 min): the Triton row sort on the GPU (its tests against the PyTorch sort, the device
# assert, the fused layer's tests incl. sync-free and CUDA-graph replay), then the layers: Qwen3 both routings, DeepSeek-V3 balanced with the compiled reference, GPT-OSS balanced.
source scripts/device_common.sh "$@"
echo "== GPU tests"
timeout -k 10 130 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_sort_rows.py \
  tests/kernels/test_moe_fused_gpu.py tests/unit/test_gpu.py -k "not compiled and not tiny_trains" 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== layers"
timeout -k 10 110 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced,skewed --reps 5 --warmup 2 \
  --backends triton,auto --graphs --no-compile --json "$out/moe_qwen3.json" 2>&1 | filter | grep -E "^qwen3|Error" | tail -16
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 200 python3 -m moetrain bench moe --shapes deepseek-v3 \
  --routing balanced --reps 5 --warmup 2 --backends auto --graphs --json "$out/moe_dsv3.json" 2>&1 | filter \
  | grep -E "^deep|Error" | tail -8
timeout -k 10 80 python3 -m moetrain bench moe --shapes gpt-oss-20b --routing balanced --reps 5 --warmup 2 \
  --backends auto --graphs --no-compile --json "$out/moe_gptoss.json" 2>&1 | filter | grep -E "^gpt|Error" | tail -8
