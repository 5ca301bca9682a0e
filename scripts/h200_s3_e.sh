#!/usr/bin/env bash
# Session 3, call E (the last ~2 min of budget): planner calibration data on four configs outside the validation set.
set -uo pipefail
out="${1:-${OUT:-/tmp/moetrain-out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout -k 5 95 python3 scripts/plan_calibrate.py cal-qwen3-2l cal-qwen3-bf16-s1k cal-llama-2l cal-tiny \
  --json "$out/calibrate.json" 2>&1 | grep -Ev "Warning|warn" | cut -c1-400 | tail -12
