#!/usr/bin/env bash
# Kernels (GPU tests + sweep vs torch), the training step against HF after the hook-leak
# fix, and the MoE layer after the combine change, in one device call (< 10 min).
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== kernel GPU tests"
timeout 110 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tail -8
echo "== grouped GEMM sweep"
timeout 230 python3 -m moetrain.kernels.sweep_grouped_gemm --shapes dsv3,qwen3 --budget 110 \
  --json "$out/sweep.json" > "$out/sweep.log" 2>&1; tail -22 "$out/sweep.log"
echo "== training step vs HF"
timeout 120 python3 -m moetrain bench train --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 15 \
  --json "$out/train_step.json" 2>&1 | tail -6
echo "== MoE layer (torch backend) after the combine change"
timeout 100 python3 -m moetrain bench moe --shapes qwen3-30b-a3b,deepseek-v3 --routing balanced --reps 6 \
  --no-compile --json "$out/bench_moe.json" 2>&1 | tail -7
