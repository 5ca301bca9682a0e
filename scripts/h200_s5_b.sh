#!/usr/bin/env bash
# Next session, call B (< 9 min): where the roofline's ~10% bias on fp32-main-grad configs comes from (the script's
# step beside the real trainer's, same process, then two validation configs in the same call), and the MoE layer at
# DeepSeek-V3 and its EP8 rank view, both routings.
source scripts/device_common.sh "$@"
echo "== calibration with the trainer's own step"
timeout -k 10 150 python3 scripts/plan_calibrate.py --trainer --json "$out/calibrate.json" cal-qwen3-2l cal-qwen3-bf16-s1k \
  cal-llama-2l 2>&1 | filter | cut -c1-220 | grep -v "^    layer\|^    head" | tail -14
echo "== plan validate, two configs"
timeout -k 10 100 python3 -m moetrain plan validate --configs qwen3-4l qwen3-bf16-state --out "$out/validate" 2>&1 | filter | tail -6
echo "== MoE layer, DeepSeek-V3 and its EP8 view"
timeout -k 10 260 python3 -m moetrain bench moe --shapes deepseek-v3,deepseek-v3-ep8 --routing balanced,skewed --reps 5 \
  --warmup 2 --backends triton,auto --json "$out/bench_moe.json" 2>&1 | filter | grep -v "^  " | tee "$out/bench_moe.log" | tail -26
