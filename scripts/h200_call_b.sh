#!/usr/bin/env bash
# Kernels (GPU tests + sweep vs torch), the MoE layer with each backend, and the training
# step against HF after the hook-leak fix, in one device call.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== kernel GPU tests"
timeout 120 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -x 2>&1 | tail -8
echo "== grouped GEMM sweep"
timeout 260 python3 -m moetrain.kernels.sweep_grouped_gemm --shapes dsv3,qwen3 --budget 150 \
  --json "$out/sweep.json" > "$out/sweep.log" 2>&1; tail -25 "$out/sweep.log"
echo "== MoE layer, backends torch and triton"
timeout 150 python3 -m moetrain bench moe --shapes qwen3-30b-a3b,deepseek-v3 --routing balanced --reps 6 \
  --no-compile --backends torch,triton --json "$out/bench_moe.json" 2>&1 | tail -9
echo "== training step vs HF"
timeout 150 python3 -m moetrain bench train --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 20 \
  --json "$out/train_step.json" 2>&1 | tail -6
