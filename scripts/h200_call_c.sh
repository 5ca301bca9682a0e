#!/usr/bin/env bash
# Short device call: kernel GPU correctness and a one-shape sweep against torch.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== kernel GPU tests"
timeout 100 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tail -8
echo "== grouped GEMM sweep (qwen3)"
timeout 120 python3 -m moetrain.kernels.sweep_grouped_gemm --shapes qwen3 --budget 60 \
  --json "$out/sweep.json" > "$out/sweep.log" 2>&1; tail -16 "$out/sweep.log"
