#!/usr/bin/env bash
# Everything session 1 left unverified on a GPU, in one device call (< 10 min):
#   1. GPU tests: trainer (torch.compile in bf16), kernels, the fused expert path, auto, graph capture
#   2. grouped GEMM sweep vs torch on the remaining shapes (Qwen3 was measured: bench/NOTES.md)
#   3. the MoE layer with each backend, after the combine change (e15cf28)
# Usage on the GPU machine from the repo root: bash scripts/device_calls/h200_pending.sh [OUT_DIR]
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== GPU tests"
timeout 200 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rf 2>&1 | tee "$out/gpu_tests.log" | tail -15
echo "== grouped GEMM sweep (DeepSeek-V3, its EP8 view, Mixtral, GPT-OSS)"
timeout 200 python3 -m moetrain bench gemm --shapes dsv3,dsv3-ep8,mixtral,gptoss --budget 150 \
  --json "$out/sweep.json" > "$out/sweep.log" 2>&1; tail -20 "$out/sweep.log"
echo "== MoE layer, backends torch / triton / auto"
timeout 160 python3 -m moetrain bench moe --shapes qwen3-30b-a3b,deepseek-v3 --routing balanced,skewed --reps 6 \
  --backends torch,triton,auto --json "$out/bench_moe.json" 2>&1 | tail -22
