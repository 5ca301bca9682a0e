#!/usr/bin/env bash
# Session 6, call E (< 5.5 min): train.cuda_graph's per-step host time, from two calibration configs, beside the
# graphed validation configs (tiny-wide-graph, qwen3-4l-graph) and the host-bound eager tiny-wide on the same host;
# then the DeepSeek-V3 and Qwen3 MoE layers (balanced), the per-expert loop now unbinding its weights.
source scripts/device_common.sh "$@"
echo "== plan validate: calibration + graphed configs"
timeout -k 10 170 python3 -m moetrain plan validate --configs cal-tiny-graph cal-qwen3-2l-graph tiny-wide-graph \
  qwen3-4l-graph tiny-wide --out "$out/validate" 2>&1 | filter | tail -9
echo "== MoE layers, balanced"
timeout -k 10 170 python3 -m moetrain bench moe --shapes deepseek-v3,qwen3-30b-a3b --routing balanced --reps 5 \
  --warmup 2 --backends triton,auto --json "$out/bench_moe.json" 2>&1 | filter > "$out/bench_moe.log"
grep -E "^deepseek|^qwen3|^shape" "$out/bench_moe.log"; grep "^    \[" "$out/bench_moe.log" | tail -8
