#!/usr/bin/env bash
# Next session, call C (~5 min): where the fused path's non-GEMM time goes (kernel profiles), and the
# training step against HF transformers with the fused path.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 150 python3 -m moetrain bench moe --shapes qwen3-30b-a3b,deepseek-v3 --routing balanced,skewed --reps 4 --warmup 2 \
  --backends auto --no-compile --profile 2>&1 | grep -Ev "Warning|warn" | cut -c1-150 | tee "$out/profile.log" | tail -90
echo "== training step vs HF transformers (the trainer now runs the fused expert path)"
timeout 150 python3 -m moetrain bench train --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 10 --warmup 3 \
  --json "$out/train_step.json" 2>&1 | grep -Ev "Warning|warn" | tail -8
