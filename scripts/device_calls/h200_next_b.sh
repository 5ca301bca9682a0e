#!/usr/bin/env bash
# Next session, call B (< 10 min): grouped GEMMs with auto's column, then the MoE layer, every shape
# and routing, against the eager and compiled references.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== grouped GEMM sweep (ours, torch, auto)"
timeout 170 python3 -m moetrain bench gemm --shapes dsv3,qwen3,dsv3-ep8,mixtral,gptoss --ops fwd,dgrad,wgrad,fwd_gather --routing balanced,skewed \
  --budget 140 --json "$out/sweep.json" > "$out/sweep.log" 2>&1; grep -A80 "^shape " "$out/sweep.log" | head -80
echo "== MoE layer"
timeout 400 python3 -m moetrain bench moe --shapes deepseek-v3,qwen3-30b-a3b,mixtral-8x7b,gpt-oss-20b,deepseek-v3-ep8 \
  --routing balanced,skewed --reps 5 --warmup 2 --backends torch,triton,auto --json "$out/bench_moe.json" 2>&1 \
  | grep -Ev "Warning|warn|softmax|Inductor|important use" | tee "$out/bench_moe.log" | tail -75
