#!/usr/bin/env bash
# Session 4, call F (< 3 min): the MoE layer at Qwen3 and DeepSeek-V3 with the benchmark's router weight in bf16 as in
# the model (ours now takes the tensor-core router GEMM there; session 3's prediction: -0.45 / -1.4 ms).
source scripts/device_common.sh "$@"
timeout -k 10 60 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_fused_gpu.py -k auto_measures 2>&1 \
  | grep -E "passed|failed|FAILED|Error" | tail -3
timeout -k 10 150 python3 -m moetrain bench moe --shapes qwen3-30b-a3b,deepseek-v3 --routing balanced --reps 5 --warmup 2 \
  --backends triton,auto --no-compile --json "$out/bench_moe.json" 2>&1 \
  | grep -Ev "Warning|warn|softmax|Inductor|important use|^  " | tee "$out/bench_moe.log" | tail -16
