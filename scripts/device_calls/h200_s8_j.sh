#!/usr/bin/env bash
# Session 8, call J (< 5.5 min): every GPU test (but the compiled ones) on the final code (the Triton row sort runs in
# the trainer's tests too), then Mixtral's layer with the final code, eager and graphed.
source scripts/device_common.sh "$@"
echo "== GPU tests"
gpu_tests 150
echo "== mixtral"
timeout -k 10 140 python3 -m moetrain bench moe --shapes mixtral-8x7b --routing balanced --reps 3 --warmup 1 \
  --backends auto --graphs --no-compile --json "$out/moe_mixtral.json" 2>&1 | filter | grep -E "^mixtral|Error" | tail -8
