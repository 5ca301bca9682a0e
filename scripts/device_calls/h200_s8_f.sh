#!/usr/bin/env bash
# Session 8, call F (< 9 min): the new trial wgrad config (two programs per SM, register stores) on the GPU (its
# skewed-routing correctness test, bench moe's small-shape test with the new allocator column), its timing at
# DeepSeek-V3 and Qwen3 against torch, then the DeepSeek-V3 EP8 rank view (32 local experts, 65536 rows; never
# measured with the compiled reference and graphs), both routings, every peer.
source scripts/device_common.sh "$@"
echo "== GPU tests (trial configs, bench moe small shape)"
timeout -k 10 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_grouped_gemm_gpu.py \
  tests/unit/test_gpu.py -k "trial_configs or bench_moe" 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== wgrad: deepseek-v3, qwen3"
timeout -k 10 130 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --ops wgrad --routing balanced --budget 100 \
  --json "$out/bench_gemm_wgrad.json" 2>&1 | filter | tee "$out/bench_gemm_wgrad.log" | grep -E "^dsv3|^qwen3|/x2" | tail -12
echo "== deepseek-v3-ep8"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout -k 10 300 python3 -m moetrain bench moe --shapes deepseek-v3-ep8 --routing balanced,skewed --reps 5 \
  --warmup 2 --backends auto --graphs --json "$out/moe_ep8.json" 2>&1 | filter | grep -v "^    \[" \
  | grep -E "^deep|Error|error|choice|fc1|fc2" | tail -40
