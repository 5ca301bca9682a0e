#!/usr/bin/env bash
# GPU tests, the training-step memory breakdown, and the MoE layer benchmark, in one device call.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== GPU tests"
timeout 150 python3 -m pytest -q -m gpu tests/unit/test_gpu.py -p no:cacheprovider 2>&1 | tail -6
echo "== training step (no peer): peak memory before/after the optimizer"
timeout 120 python3 -m moetrain bench train --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 12 \
  --warmup 4 --no-peer --json "$out/train_step_mem.json" 2>&1 | tail -4
python3 -c "
import json; rows = json.load(open('$out/train_step_mem.json'))['rows']
for r in rows: print(f\"{r['name']:28s} peak {r['peak_mem_gib']:.1f} GiB, before optimizer {r['peak_mem_fwd_bwd_gib']:.1f} GiB\")"
echo "== MoE layer benchmark"
timeout 330 python3 -m moetrain bench moe --reps 8 --json "$out/bench_moe.json" 2>&1 | tail -30
