#!/usr/bin/env bash
# Session 4, call D (< 9 min): the MoE layer at DeepSeek-V3 (no graphs: three graphed contenders' private pools hold
# 22 GB of weight gradients each there) and Qwen3 (with graphs: what host gaps cost), the tensor-core router GEMM and
# auto's routing kernel inside; then the grouped GEMMs of both shapes, torch / our best / auto timed interleaved.
source scripts/device_common.sh "$@"
echo "== MoE layer, DeepSeek-V3"
timeout -k 10 200 python3 -m moetrain bench moe --shapes deepseek-v3 --routing balanced,skewed --reps 5 --warmup 2 \
  --backends triton,auto --json "$out/bench_moe_dsv3.json" 2>&1 | filter | tee "$out/bench_moe_dsv3.log" | tail -16
echo "== MoE layer, Qwen3 (graphs)"
timeout -k 10 150 python3 -m moetrain bench moe --shapes qwen3-30b-a3b --routing balanced,skewed --reps 5 --warmup 2 \
  --backends triton,auto --graphs --json "$out/bench_moe_qwen3.json" 2>&1 | filter | tee "$out/bench_moe_qwen3.log" | tail -20
echo "== grouped GEMMs"
timeout -k 10 150 python3 -m moetrain bench gemm --shapes dsv3,qwen3 --ops fwd,dgrad,wgrad --routing balanced \
  --budget 100 --json "$out/bench_gemm.json" 2>&1 | filter | tee "$out/bench_gemm.log" | tail -24
