#!/usr/bin/env bash
# Short device call: the training step against HF after the hook-leak fix, kernel GPU
# correctness, and a one-shape grouped GEMM sweep against torch.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== training step vs HF"
timeout 100 python3 -m moetrain bench train --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 12 \
  --warmup 4 --json "$out/train_step.json" 2>&1 | tail -6
echo "== kernel GPU tests"
timeout 90 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tail -8
echo "== grouped GEMM sweep (qwen3)"
timeout 100 python3 -m moetrain.kernels.sweep_grouped_gemm --shapes qwen3 --budget 50 \
  --json "$out/sweep.json" > "$out/sweep.log" 2>&1; tail -16 "$out/sweep.log"
