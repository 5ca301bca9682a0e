#!/usr/bin/env bash
# The fused expert path (Triton row kernels + per-op auto GEMMs) on the H200, in one device call:
#   1. every kernel test on the GPU (bf16 row kernels, fused path, auto, graph capture) + trainer GPU tests
#   2. the MoE layer, all issue shapes, balanced and skewed, against eager / compiled references
# Usage on the GPU machine from the repo root: bash scripts/device_calls/h200_fused.sh [OUT_DIR]
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== GPU tests (kernels, fused path, trainer)"
timeout 200 python3 -m pytest -q tests/kernels tests/unit/test_gpu.py -p no:cacheprovider -rf 2>&1 \
  | tee "$out/gpu_tests.log" | grep -Ev "Warning|warn" | tail -12
echo "== MoE layer"
timeout 370 python3 -m moetrain bench moe --shapes deepseek-v3,qwen3-30b-a3b,mixtral-8x7b,gpt-oss-20b,deepseek-v3-ep8 \
  --routing balanced,skewed --reps 5 --warmup 2 --backends torch,triton,auto --json "$out/bench_moe.json" 2>&1 \
  | grep -Ev "Warning|warn" | tee "$out/bench_moe.log"
